// Colour scales of the token view. Both are fixed (not per step), so a colour means
// the same value on every step and every run; tests/skyrl_train/viewer reproduce them.
"use strict";
(function () {
  const WHITE = [255, 255, 255];
  // |rollout - trainer log-prob|: log scale, 1e-3 or less white, 1 or more dark red.
  const DIFF_STOPS = [[0, WHITE], [0.5, [253, 174, 97]], [1, [165, 0, 38]]];
  const DIFF_LOW = 1e-3, DIFF_DECADES = 3;
  // advantage: -2 or less red, 0 white, +2 or more green.
  const ADV_LIMIT = 2;
  const ADV_NEG = [215, 48, 39], ADV_POS = [26, 152, 80];

  function mix(a, b, t) {
    return a.map((v, i) => Math.round(v + (b[i] - v) * t));
  }
  function ramp(stops, t) {
    for (let i = 1; i < stops.length; i++) {
      if (t <= stops[i][0]) {
        const [t0, c0] = stops[i - 1], [t1, c1] = stops[i];
        return mix(c0, c1, (t - t0) / (t1 - t0));
      }
    }
    return stops[stops.length - 1][1].slice();
  }
  const clamp = (x, lo, hi) => Math.min(hi, Math.max(lo, x));

  // The rgb triple for a value, or null for a value the scale does not colour.
  function colour(mode, value) {
    if (value === null || value === undefined || !Number.isFinite(value)) return null;
    if (mode === "diff") {
      const t = clamp(Math.log10(Math.max(value, DIFF_LOW) / DIFF_LOW) / DIFF_DECADES, 0, 1);
      return ramp(DIFF_STOPS, t);
    }
    if (mode === "advantage") {
      const t = clamp(value / ADV_LIMIT, -1, 1);
      return t < 0 ? mix(WHITE, ADV_NEG, -t) : mix(WHITE, ADV_POS, t);
    }
    return null;
  }
  const css = (rgb) => `rgb(${rgb[0]}, ${rgb[1]}, ${rgb[2]})`;
  const dark = (rgb) => 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 140;

  // A gradient bar with ticks, for the mode shown.
  function legend(mode) {
    let ticks, values;
    if (mode === "diff") {
      ticks = ["≤ 0.001", "0.01", "0.1", "≥ 1"];
      values = [1e-3, 1e-2, 1e-1, 1];
    } else if (mode === "advantage") {
      ticks = ["≤ −2", "−1", "0", "+1", "≥ +2"];
      values = [-2, -1, 0, 1, 2];
    } else {
      return "";
    }
    const n = 24, first = values[0], last = values[values.length - 1];
    const stops = [];
    for (let i = 0; i <= n; i++) {
      const v = mode === "diff" ? first * Math.pow(last / first, i / n) : first + (last - first) * i / n;
      stops.push(`${css(colour(mode, v))} ${(100 * i / n).toFixed(1)}%`);
    }
    const tickHtml = ticks.map((t) => `<span>${t}</span>`).join("");
    return `<span class="legend"><span class="legend-bar" style="background: linear-gradient(to right, ` +
      `${stops.join(", ")})"></span><span class="legend-ticks">${tickHtml}</span></span>` +
      `<span class="legend-note">uncoloured: no value (observation tokens, missing log-probs)</span>`;
  }

  window.skyrlColours = { colour, css, dark, legend, DIFF_LOW, DIFF_DECADES, ADV_LIMIT };
})();
