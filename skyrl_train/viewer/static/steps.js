// The step selector and a step's rollouts: its trajectories grouped by GRPO group,
// side by side, and the step's expert-load heatmap. Only dumped steps are offered;
// a dump that cannot be read shows its message (naming the file) at its step.
"use strict";
(function () {
  const state = { run: 0, kind: "train", step: null, shown: 0 };
  let manifest = null;

  const $ = (id) => document.getElementById(id);
  const run = () => manifest.runs[state.run];
  const short = (v) => (typeof v === "number" ? String(Number(v.toPrecision(4))) : String(v));
  const dumps = () => run().dumps.filter((d) => d.kind === state.kind);

  function nearest(step) {
    const list = dumps();
    if (!list.length) return null;
    let best = list[0];
    for (const d of list) if (Math.abs(d.step - step) < Math.abs(best.step - step)) best = d;
    return best;
  }

  function message(text) {
    const box = $("step-message");
    box.hidden = !text;
    box.textContent = text || "";
  }

  function card(traj, onOpen) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "traj-card";
    button.dataset.index = String(traj.index);
    button.dataset.group = String(traj.group);
    const turns = (traj.turns || []).map((t) => short(t.reward)).join(" · ");
    const policyTokens = (traj.loss_mask || []).filter((m) => m === 1).length;
    const solved = traj.solved === true ? " ✓ solved" : traj.solved === false ? " ✗" : "";
    const preview = (traj.tokens || []).filter((_, i) => traj.loss_mask && traj.loss_mask[i] === 1)
      .join("").slice(0, 60);
    button.innerHTML = '<div class="card-head"></div><div class="card-reward"></div>' +
      '<div class="card-turns"></div><div class="card-meta"></div><div class="card-preview"></div>';
    button.querySelector(".card-head").textContent = `#${traj.index} · sample ${traj.sample}`;
    button.querySelector(".card-reward").textContent = `reward ${short(traj.reward)}${solved}`;
    button.querySelector(".card-turns").textContent = turns ? `turns: ${turns}` : "no turns";
    button.querySelector(".card-meta").textContent =
      `${traj.stop_reason || "?"} · ${policyTokens}/${traj.response_ids.length} sampled tokens`;
    button.querySelector(".card-preview").textContent = preview;
    button.addEventListener("click", () => {
      document.querySelectorAll(".traj-card.selected").forEach((b) => b.classList.remove("selected"));
      button.classList.add("selected");
      onOpen(traj);
    });
    return button;
  }

  function renderGroups(doc, where) {
    const box = $("groups");
    box.innerHTML = "";
    const groups = new Map();
    for (const traj of doc.trajectories) {
      if (!groups.has(traj.group)) groups.set(traj.group, []);
      groups.get(traj.group).push(traj);
    }
    if (!groups.size) box.innerHTML = '<p class="hint">This dump holds no trajectories.</p>';
    for (const [group, trajs] of [...groups.entries()].sort((a, b) => a[0] - b[0])) {
      const row = document.createElement("div");
      row.className = "group";
      row.dataset.group = String(group);
      const mean = trajs.reduce((s, t) => s + (Number(t.reward) || 0), 0) / trajs.length;
      const label = document.createElement("div");
      label.className = "group-label";
      label.textContent = `group ${group} · ${trajs.length} samples · mean reward ${mean.toFixed(3)}`;
      const cards = document.createElement("div");
      cards.className = "group-cards";
      trajs.sort((a, b) => a.sample - b.sample)
        .forEach((t) => cards.appendChild(card(t, (traj) => window.skyrlTokens.show(doc, traj, where))));
      row.append(label, cards);
      box.appendChild(row);
    }
  }

  function clearExpertLoad(html) {
    const div = $("expert-load");
    if (window.Plotly) Plotly.purge(div);
    div.innerHTML = html;
  }

  function renderExpertLoad(doc, where, token) {
    if (!Array.isArray(doc.expert_load) || !doc.expert_load.length) {
      clearExpertLoad('<p class="hint">No expert load in this dump (a dense model, or not recorded).</p>');
      return;
    }
    window.skyrlPlotly.then(() => {
      if (token === state.shown) drawExpertLoad(doc, where);
    }, () => clearExpertLoad('<p class="hint">No heatmap: Plotly did not load.</p>'));
  }

  function drawExpertLoad(doc, where) {
    const div = $("expert-load");
    div.innerHTML = "";
    Plotly.newPlot(div, [{
      type: "heatmap", z: doc.expert_load, colorscale: "Viridis",
      colorbar: { title: { text: "tokens" } },
      hovertemplate: "layer %{y}<br>expert %{x}<br>%{z} tokens<extra></extra>",
    }], {
      title: { text: `expert load, ${where}: tokens routed to each expert`, font: { size: 13 } },
      height: 320, margin: { l: 60, r: 10, t: 36, b: 40 },
      xaxis: { title: { text: "expert" }, dtick: 1 }, yaxis: { title: { text: "MoE layer" }, dtick: 1 },
    }, { displaylogo: false, responsive: true });
  }

  function show(step) {
    const list = dumps();
    $("trajectory-section").hidden = true;
    if (!list.length) {
      state.step = null;
      $("step-position").textContent = "";
      $("groups").innerHTML = "";
      clearExpertLoad("");
      message(`${run().name}: no ${state.kind} rollout dumps (logging.dump_rollouts is 0, or no step has finished)`);
      document.body.dataset.stepState = "empty";
      return;
    }
    const dump = nearest(step === null ? list[0].step : step);
    state.step = dump.step;
    const position = list.indexOf(dump);
    $("step-input").value = String(dump.step);
    $("step-position").textContent = `${position + 1} of ${list.length} dumped ${state.kind} steps ` +
      `(${run().num_metric_steps} steps in metrics)`;
    $("prev-step").disabled = position === 0;
    $("next-step").disabled = position === list.length - 1;
    history.replaceState(null, "", `#run=${state.run}&kind=${state.kind}&step=${dump.step}`);
    const token = ++state.shown;
    document.body.dataset.stepState = "loading";
    const where = `step ${dump.step} (${state.kind})`;
    window.skyrlLoader.loadDump(run().id, state.kind, dump.step, dump.url).then((doc) => {
      if (token !== state.shown) return;
      message("");
      renderGroups(doc, where);
      renderExpertLoad(doc, where, token);
      document.body.dataset.stepState = "ready";
      if (!window.__skyrlTimings.firstStep) window.__skyrlTimings.firstStep = performance.now();
    }, (err) => {
      if (token !== state.shown) return;
      $("groups").innerHTML = "";
      clearExpertLoad("");
      message(`${where}: ${err.message}`);
      document.body.dataset.stepState = "error";
    });
  }

  function move(delta) {
    const list = dumps();
    const i = list.findIndex((d) => d.step === state.step) + delta;
    if (i >= 0 && i < list.length) show(list[i].step);
  }

  function init(m) {
    manifest = m;
    const select = $("run-select");
    m.runs.forEach((r, i) => select.add(new Option(r.name, String(i))));
    const params = new URLSearchParams(location.hash.slice(1));
    state.run = Math.min(Number(params.get("run")) || 0, m.runs.length - 1);
    state.kind = params.get("kind") === "eval" ? "eval" : "train";
    select.value = String(state.run);
    document.querySelector(`input[name="kind"][value="${state.kind}"]`).checked = true;
    select.addEventListener("change", () => { state.run = Number(select.value); show(state.step); });
    document.querySelectorAll('input[name="kind"]').forEach((input) =>
      input.addEventListener("change", () => { state.kind = input.value; show(state.step); }));
    $("prev-step").addEventListener("click", () => move(-1));
    $("next-step").addEventListener("click", () => move(1));
    const jump = () => show(Number($("step-input").value));
    $("go-step").addEventListener("click", jump);
    $("step-input").addEventListener("keydown", (e) => { if (e.key === "Enter") jump(); });
    document.addEventListener("keydown", (e) => {
      if (e.target.tagName === "INPUT" || e.target.tagName === "SELECT") return;
      if (e.key === "ArrowLeft") move(-1);
      if (e.key === "ArrowRight") move(1);
    });
    const step = params.has("step") ? Number(params.get("step")) : null;
    show(step);
  }

  // Opens the dumped step nearest `step` of run `runIndex` (a click on a plot).
  function pick(runIndex, step) {
    state.run = runIndex;
    $("run-select").value = String(runIndex);
    show(step);
    $("steps-section").scrollIntoView({ behavior: "smooth" });
  }

  window.skyrlSteps = { init, pick };
})();
