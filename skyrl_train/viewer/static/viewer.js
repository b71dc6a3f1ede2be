// Starts the page: checks that the manifest loaded (a clear message if not, never a
// blank page), lists the runs and their warnings, starts the step view, then loads
// Plotly and draws the metrics plots.
"use strict";
(function () {
  window.__skyrlTimings = window.__skyrlTimings || {};
  const fatal = (text) => {
    const box = document.getElementById("fatal");
    box.hidden = false;
    box.textContent = text;
    document.body.dataset.fatal = "1";
  };
  const manifest = window.__skyrlManifest;
  if (!manifest || !Array.isArray(manifest.runs)) {
    fatal(window.__skyrlManifestError ||
      "data/manifest.js did not load: write the page again with python -m skyrl_train.entrypoints.view RUN_DIR");
    return;
  }
  document.getElementById("run-names").textContent = manifest.runs
    .map((r) => `${r.name} (${r.path}): ${r.num_metric_steps} steps, ${r.dumps.length} dumps`).join(" · ");
  const warnings = manifest.runs.flatMap((r) => r.warnings);
  if (warnings.length) {
    const box = document.getElementById("warnings");
    box.hidden = false;
    box.textContent = warnings.join("\n");
  }
  window.skyrlTokens.init();
  // Plotly (4.8 MB) takes about a second to start: the step view (which needs it only
  // for its heatmap) starts first, and the plots are drawn once it has loaded.
  const tag = document.createElement("script");
  tag.src = "assets/plotly.min.js";
  window.skyrlPlotly = new Promise((resolve, reject) => {
    tag.onload = () => (window.Plotly ? resolve(window.Plotly) : reject(new Error("no Plotly")));
    tag.onerror = () => reject(new Error("could not be loaded"));
  });
  window.skyrlSteps.init(manifest);  // its first dump is asked for before Plotly
  document.head.appendChild(tag);
  window.skyrlPlotly.then(
    () => window.skyrlMetrics.render(manifest, document.getElementById("metrics"), window.skyrlSteps.pick),
    (err) => fatal(`assets/plotly.min.js: ${err.message}; no plots (write the page again with ` +
      "python -m skyrl_train.entrypoints.view RUN_DIR)"),
  );
})();
