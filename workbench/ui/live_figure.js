// The view of workbench.ui.live.LiveFigure: one plotly.js chart, drawn again with Plotly.react from
// each figure the kernel sends. What a person did to it (a zoom, a pan, a trace hidden from the
// legend) stays while the figure's uirevisions stay (the kernel sets one per axis: its title).
//
// anywidget gives a model 2 s to load this module, and a model whose module loads later never hears
// from the kernel again: so nothing comes to this model after it is made. plotly.js is in its first
// state (evaluated once per page), and the figures come through a plain ipywidgets model (`_figures`).

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

async function render({ model, el, host }) {
  const [Plotly, figures] = await Promise.all([plotly(model), host.getModel(model.get("_figures"))]);
  const chart = document.createElement("div");
  el.appendChild(chart);
  let queue = Promise.resolve(); // one draw at a time, in the order the figures came
  const draw = () => {
    const figure = JSON.parse(figures.get("figure") || "null");
    if (figure) {
      queue = queue.then(() => Plotly.react(chart, figure.data, figure.layout, { displaylogo: false }))
        .catch((e) => console.error("workbench: the chart was not drawn", e));
    }
  };
  figures.on("change:figure", draw);
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
    figures.off("change:figure", draw);
    Plotly.purge(chart);
  };
}

export default { render };
