// The metrics plots: one Plotly chart per panel of the manifest, every run overlaid
// (legend: the run folder's name). Panels are drawn one per task so the first plot
// shows at once and the page stays responsive on a 10,000-step run.
"use strict";
(function () {
  const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"];
  const DASHES = ["solid", "dot", "dash", "dashdot", "longdash"];

  function traces(manifest, panel) {
    const runs = manifest.runs, several = runs.length > 1, out = [];
    panel.series.forEach((series, si) => {
      runs.forEach((run, ri) => {
        const points = run.metrics[series.key];
        if (!points) return;
        let name = series.label;
        if (several) name = panel.series.length > 1 ? `${run.name} · ${series.label}` : run.name;
        out.push({
          type: "scatter",
          mode: points[0].length > 60 ? "lines" : "lines+markers",
          x: points[0],
          y: points[1],
          name,
          meta: { run: ri, key: series.key },
          line: { color: COLOURS[(several ? ri : si) % COLOURS.length], width: 1.5,
                  dash: several ? DASHES[si % DASHES.length] : "solid" },
          marker: { size: 4 },
          hovertemplate: `${name}<br>step %{x}<br>%{y:.4g}<extra></extra>`,
        });
      });
    });
    return out;
  }

  // Draws the panels into `container`; `onPick(runIndex, step)` on a click on a point.
  // Resolves once every panel is drawn (document.body.dataset.metricsReady is then "1").
  function render(manifest, container, onPick) {
    const todo = manifest.panels
      .map((panel) => ({ panel, data: traces(manifest, panel) }))
      .filter((item) => item.data.length > 0);
    if (todo.length === 0) {
      container.innerHTML = '<p class="hint">No metrics to plot (metrics.jsonl is missing or empty).</p>';
    }
    return new Promise((resolve) => {
      const next = () => {
        const item = todo.shift();
        if (!item) {
          window.__skyrlTimings.allPlots = performance.now();
          document.body.dataset.metricsReady = "1";
          resolve();
          return;
        }
        const div = document.createElement("div");
        div.className = "plot";
        div.dataset.panel = item.panel.title;
        div.dataset.keys = item.panel.series.map((s) => s.key).join(" ");
        container.appendChild(div);
        Plotly.newPlot(div, item.data, {
          title: { text: item.panel.title, font: { size: 13 } },
          height: 300,
          margin: { l: 50, r: 10, t: 36, b: 20 },
          legend: { orientation: "h", y: -0.12, font: { size: 10 } },
          hovermode: "closest",
        }, { displaylogo: false, responsive: true }).then(() => {
          if (!window.__skyrlTimings.firstPlot) window.__skyrlTimings.firstPlot = performance.now();
          div.on("plotly_click", (event) => {
            const point = event.points && event.points[0];
            if (point) onPick(point.data.meta.run, point.x);
          });
        }, (err) => {
          div.textContent = `${item.panel.title}: could not be drawn (${err})`;
        }).then(() => setTimeout(next, 0));
      };
      next();
    });
  }

  window.skyrlMetrics = { render };
})();
