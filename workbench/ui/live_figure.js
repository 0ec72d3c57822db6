// The view of workbench.ui.live.LiveFigure: one plotly.js chart, drawn again with Plotly.react from
// each figure the kernel sends. What a person did to it (a zoom, a pan, a trace hidden from the
// legend) stays while the figure's uirevisions stay (the kernel sets one per axis: its title).
//
// This module is small on purpose: anywidget gives a model 2 s to load its module, and a model
// whose module loads later never hears from the kernel again. plotly.FigureWidget's module is all
// of plotly.js (5 MB); under load it missed the 2 s and its chart stayed blank and fixed in width
// for good. plotly.js comes here as a trait instead, and is evaluated once per page.

function plotly(model) {
  const key = `__workbench_plotly_${model.get("_plotly_version")}`;
  window[key] ??= new Promise((resolve, reject) => {
    const script = document.createElement("script");
    script.src = URL.createObjectURL(new Blob([model.get("_plotly_js")], { type: "text/javascript" }));
    script.onload = () => {
      URL.revokeObjectURL(script.src);
      resolve(window.Plotly); // the bundle's last line: window.Plotly = Plotly
    };
    script.onerror = () => reject(new Error("workbench: plotly.js did not load"));
    document.head.appendChild(script);
  });
  return window[key];
}

async function render({ model, el }) {
  const Plotly = await plotly(model);
  const chart = document.createElement("div");
  el.appendChild(chart);
  let queue = Promise.resolve(); // one draw at a time, in the order the figures came
  const draw = () => {
    const figure = JSON.parse(model.get("_figure") || "null");
    if (figure) {
      queue = queue.then(() => Plotly.react(chart, figure.data, figure.layout, { displaylogo: false }))
        .catch((e) => console.error("workbench: the chart was not drawn", e));
    }
  };
  model.on("change:_figure", draw);
  draw();
  // Its box's width, followed: a window resize, a side panel opened or closed, the chart shown again
  // after it was hidden, or first placed on the page (drawn before that, into a box with no width,
  // plotly.js takes 700 px).
  let width = 0;
  const observer = new ResizeObserver(() => {
    if (el.clientWidth > 0 && el.clientWidth !== width) {
      width = el.clientWidth;
      queue = queue.then(() => chart.layout && Plotly.Plots.resize(chart)).catch(() => {});
    }
  });
  observer.observe(el);
  return () => {
    observer.disconnect();
    model.off("change:_figure", draw);
    Plotly.purge(chart);
  };
}

export default { render };
