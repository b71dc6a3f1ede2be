// One trajectory's conversation: the prompt as text, then every response token as an
// element carrying its values (data-*), coloured by the chosen scale. Observation
// tokens (loss mask 0: the environment's, not sampled) are styled apart and never
// coloured; nor is a token whose value is null.
"use strict";
(function () {
  const C = window.skyrlColours;
  let current = null;   // { traj, spans }
  let pinned = null;

  const short = (v) => (typeof v === "number" ? String(Number(v.toPrecision(4))) : String(v));
  const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);
  const fmt = (v) => (v === null ? "—" : Math.abs(v) >= 1e-3 || v === 0 ? v.toFixed(4) : v.toExponential(2));
  const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

  function at(list, i) { return list ? num(list[i]) : null; }

  function tokenValue(traj, i, mode) {
    if (!traj.loss_mask || traj.loss_mask[i] !== 1) return null;
    if (mode === "advantage") return at(traj.advantages, i);
    if (mode === "diff") {
      const r = at(traj.rollout_logprobs, i), t = at(traj.trainer_logprobs, i);
      return r === null || t === null ? null : Math.abs(r - t);
    }
    return null;
  }

  function recolour(mode) {
    document.getElementById("colour-legend").innerHTML = C.legend(mode);
    if (!current) return;
    current.spans.forEach((span, i) => {
      const rgb = C.colour(mode, tokenValue(current.traj, i, mode));
      span.style.backgroundColor = rgb ? C.css(rgb) : "";
      span.style.color = rgb && C.dark(rgb) ? "#fff" : "";
      span.classList.toggle("coloured", !!rgb);
    });
  }

  function flipsText(flips, i) {
    if (!flips) return "not recorded";
    const layers = flips[i] || [];
    return layers.length ? `layers ${layers.join(", ")}` : "none";
  }

  function detail(i) {
    const t = current.traj;
    const sampled = t.loss_mask && t.loss_mask[i] === 1;
    // An observation token has no rollout log-prob (dumped as 0.0): no |Δ| either.
    const r = sampled ? at(t.rollout_logprobs, i) : null, tr = at(t.trainer_logprobs, i);
    const turn = (t.turns || []).findIndex((x) => i >= x.start && i < x.end);
    const rows = [
      ["token", `#${i} ${esc(JSON.stringify(t.tokens ? t.tokens[i] : ""))}`],
      ["id", t.response_ids[i]],
      ["sampled", sampled ? `yes (turn ${turn + 1})` : "no (observation)"],
      ["rollout log-prob", fmt(r)],
      ["trainer log-prob", fmt(tr)],
      ["|Δ log-prob|", fmt(r === null || tr === null ? null : Math.abs(r - tr))],
      ["advantage", fmt(at(t.advantages, i))],
      ["router flips (trained)", flipsText(t.router_flips, i)],
      ["router flips (native)", flipsText(t.router_flips_native, i)],
    ];
    const box = document.getElementById("token-detail");
    box.innerHTML = `<table>${rows.map(([k, v]) => `<tr><th>${k}</th><td>${v}</td></tr>`).join("")}</table>` +
      (pinned !== null ? '<p class="hint">pinned: click the token again to release</p>' : "");
    box.dataset.index = String(i);
  }

  function setData(span, name, value) {
    if (value !== null && value !== undefined) span.dataset[name] = String(value);
  }

  function tokenSpan(t, i) {
    const span = document.createElement("span");
    const policy = t.loss_mask && t.loss_mask[i] === 1;
    span.className = policy ? "tok policy" : "tok obs";
    const text = t.tokens ? t.tokens[i] : String(t.response_ids[i]);
    // A newline stays a line break, after a mark that can be coloured and hovered.
    span.textContent = text === "" ? "∅" : text.replace(/\n/g, "↵\n");
    span.dataset.index = String(i);
    setData(span, "id", t.response_ids[i]);
    setData(span, "mask", t.loss_mask ? t.loss_mask[i] : null);
    setData(span, "rolloutLogprob", at(t.rollout_logprobs, i));
    setData(span, "trainerLogprob", at(t.trainer_logprobs, i));
    setData(span, "advantage", at(t.advantages, i));
    if (t.router_flips) span.dataset.flips = (t.router_flips[i] || []).join(",");
    if (t.router_flips_native) span.dataset.flipsNative = (t.router_flips_native[i] || []).join(",");
    if ((t.router_flips && (t.router_flips[i] || []).length) ||
        (t.router_flips_native && (t.router_flips_native[i] || []).length)) span.classList.add("flipped");
    return span;
  }

  // Shows `traj` of the dump `doc`; `where` names the step for the title.
  function show(doc, traj, where) {
    const section = document.getElementById("trajectory-section");
    section.hidden = false;
    document.getElementById("trajectory-title").textContent =
      `Trajectory #${traj.index} (group ${traj.group}, sample ${traj.sample}) · ${where} · reward ${short(traj.reward)}`;
    const box = document.getElementById("conversation");
    box.innerHTML = "";
    const prompt = document.createElement("pre");
    prompt.className = "prompt";
    prompt.textContent = traj.prompt_text || "";
    box.appendChild(prompt);
    const response = document.createElement("div");
    response.className = "response";
    response.dataset.trajectory = String(traj.index);
    const ends = new Map((traj.turns || []).map((turn, k) => [turn.end - 1, [turn, k]]));
    const spans = [];
    const frag = document.createDocumentFragment();
    for (let i = 0; i < traj.response_ids.length; i++) {
      const span = tokenSpan(traj, i);
      spans.push(span);
      frag.appendChild(span);
      if (ends.has(i)) {
        const [turn, k] = ends.get(i);
        const mark = document.createElement("span");
        mark.className = "turn-mark";
        const versions = (turn.policy_versions || []).join(", ");
        mark.textContent = `turn ${k + 1}: reward ${short(turn.reward)}` + (versions ? ` · policy v${versions}` : "");
        frag.appendChild(mark);
      }
    }
    response.appendChild(frag);
    box.appendChild(response);
    current = { traj, spans };
    pinned = null;
    document.getElementById("token-detail").innerHTML = "<em>Hover or click a token for its values.</em>";
    recolour(document.querySelector('input[name="colour"]:checked').value);
    if (!window.__skyrlTimings.firstTrajectory) window.__skyrlTimings.firstTrajectory = performance.now();
  }

  function init() {
    const box = document.getElementById("conversation");
    box.addEventListener("mouseover", (event) => {
      const span = event.target.closest(".tok");
      if (span && current && pinned === null) detail(Number(span.dataset.index));
    });
    box.addEventListener("click", (event) => {
      const span = event.target.closest(".tok");
      if (!span || !current) return;
      const i = Number(span.dataset.index);
      box.querySelectorAll(".tok.pinned").forEach((s) => s.classList.remove("pinned"));
      pinned = pinned === i ? null : i;
      if (pinned !== null) span.classList.add("pinned");
      detail(i);
    });
    document.querySelectorAll('input[name="colour"]').forEach((input) =>
      input.addEventListener("change", () => recolour(input.value)));
    recolour("diff");
  }

  window.skyrlTokens = { show, init, tokenValue };
})();
