// chart.js: a uPlot line chart of scores (over time or over steps), with marked points drawn as red downward
// triangles (a shape and a colour apart from the plain points) and a click on a point handed to onPick(index).

import { h } from './dom.js';
import { loadUPlot } from './lazy.js';

const BLUE = '#1f5fbf';
const RED = '#b42318';

/**
 * container: an element (emptied); xs, ys: the data (ys may hold null); options:
 *   time (x in unix seconds, else plain numbers), label (the series name), marked (a Set of indexes to mark),
 *   onPick(index) (a click on the chart picks the point under the cursor), xLabel, yLabel.
 */
export async function scoreChart(container, xs, ys, options = {}) {
  const uPlot = await loadUPlot();
  container.replaceChildren();
  const marked = options.marked || new Set();
  const width = () => Math.max(280, container.clientWidth || 600);
  const finite = ys.filter((y) => y !== null && y !== undefined);
  const low = Math.min(0, ...finite);
  const high = Math.max(1, ...finite);
  const opts = {
    width: width(),
    height: options.height || 260,
    legend: { show: false },
    cursor: { points: { size: 10 }, drag: { x: false, y: false } },
    scales: {
      x: { time: Boolean(options.time), range: xs.length === 1 ? (u, min, max) => [min - 1, max + 1] : undefined },
      y: { range: () => [low - (high - low) * 0.08, high + (high - low) * 0.08] },
    },
    axes: [
      { label: options.xLabel, stroke: '#444', grid: { stroke: '#e6e9ed' },
        ...(options.time ? {} : { incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] }) },
      { label: options.yLabel || 'score', stroke: '#444', grid: { stroke: '#e6e9ed' }, size: 56 },
    ],
    series: [
      {},
      { label: options.label || 'score', stroke: BLUE, width: 2, spanGaps: true,
        points: { show: true, size: 7, fill: BLUE, stroke: BLUE } },
    ],
    hooks: { draw: [(u) => drawMarks(u, xs, ys, marked)] },
  };
  const plot = new uPlot(opts, [xs, ys], container);
  if (options.onPick) {
    plot.over.addEventListener('click', () => {
      const index = plot.cursor.idx;
      if (index !== null && index !== undefined && ys[index] !== null) options.onPick(index);
    });
  }
  const resize = new ResizeObserver(() => plot.setSize({ width: width(), height: opts.height }));
  resize.observe(container);
  return { plot, destroy: () => { resize.disconnect(); plot.destroy(); } };
}

function drawMarks(u, xs, ys, marked) {
  const ctx = u.ctx;
  const size = 8 * devicePixelRatio;
  ctx.save();
  for (const i of marked) {
    if (ys[i] === null || ys[i] === undefined) continue;
    const x = u.valToPos(xs[i], 'x', true);
    const y = u.valToPos(ys[i], 'y', true);
    ctx.beginPath();
    ctx.moveTo(x - size, y - size * 0.6);
    ctx.lineTo(x + size, y - size * 0.6);
    ctx.lineTo(x, y + size * 0.9);
    ctx.closePath();
    ctx.fillStyle = RED;
    ctx.strokeStyle = '#fff';
    ctx.lineWidth = 1.5 * devicePixelRatio;
    ctx.fill();
    ctx.stroke();
  }
  ctx.restore();
}

/** The key under a chart: the point and the marked point, shown as the same shapes. */
export function chartLegend(markedText) {
  return h('p', { class: 'chart-legend' },
    h('span', {}, h('span', { class: 'mark-score', 'aria-hidden': 'true' }, '●'), ' score'),
    markedText ? h('span', {}, h('span', { class: 'mark-regressed', 'aria-hidden': 'true' }, '▼'), ` ${markedText}`) : null);
}
