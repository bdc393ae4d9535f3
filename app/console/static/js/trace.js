// trace.js: a Chrome trace (traceEvents: ph "X" spans with ts/dur in µs on pid/tid lanes, ph "M" names) drawn as
// a waterfall of plain DOM bars, one row per lane, at most MAX_BARS bars; each bar's title is its tooltip.

import { h } from './dom.js';
import * as fmt from './format.js';

export const MAX_BARS = 3000;
const FAILED = new Set(['failed', 'error', 'errored', 'cancelled']);

export function drawTrace(trace) {
  const events = (trace && trace.traceEvents) || [];
  const processes = new Map();
  const threads = new Map();
  const spans = [];
  for (const e of events) {
    if (e.ph === 'X' && typeof e.ts === 'number') spans.push(e);
    else if (e.ph === 'M' && e.name === 'process_name') processes.set(e.pid, e.args && e.args.name);
    else if (e.ph === 'M' && e.name === 'thread_name') threads.set(`${e.pid}:${e.tid}`, e.args && e.args.name);
  }
  const wrap = h('div', { class: 'waterfall', 'data-testid': 'trace-waterfall', 'data-spans': spans.length });
  if (!spans.length) {
    wrap.append(h('p', { class: 'muted' }, 'The trace has no spans yet.'));
    return wrap;
  }
  spans.sort((a, b) => a.ts - b.ts);
  const shown = spans.slice(0, MAX_BARS);
  const t0 = shown[0].ts;
  const t1 = Math.max(...shown.map((e) => e.ts + (e.dur || 0)));
  const total = Math.max(t1 - t0, 1);

  // lanes: by process, then thread
  const lanes = new Map();
  for (const e of shown) {
    const key = `${e.pid}:${e.tid}`;
    if (!lanes.has(key)) lanes.set(key, { pid: e.pid, tid: e.tid, spans: [] });
    lanes.get(key).spans.push(e);
  }
  const ordered = [...lanes.values()].sort((a, b) => cmp(a.pid, b.pid) || cmp(a.tid, b.tid));

  const failed = shown.filter(isFailed).length;
  const note = spans.length > MAX_BARS
    ? `Showing the first ${fmt.number(MAX_BARS)} of ${fmt.number(spans.length)} spans (download the trace for all).`
    : `${fmt.number(spans.length)} spans over ${fmt.seconds(total / 1e6)} on ${ordered.length} lanes` +
      (failed ? `, ${fmt.number(failed)} failed (hatched red).` : '.');
  const truncatedNote = trace.otherData && trace.otherData.truncated ? ` The server sent ${trace.otherData.truncated}.` : '';
  wrap.append(h('p', { class: 'legend', 'data-testid': 'trace-note' }, note + truncatedNote + ' Hover a bar for its details.'));

  const inner = h('div', { class: 'wf-inner', role: 'group', 'aria-label': `Trace waterfall: ${note}` });
  inner.append(axis(total));
  let lastPid;
  for (const lane of ordered) {
    if (lane.pid !== lastPid) {
      lastPid = lane.pid;
      inner.append(h('div', { class: 'wf-group' }, processes.get(lane.pid) || `process ${lane.pid}`));
    }
    const track = h('div', { class: 'wf-track' });
    for (const e of lane.spans) track.append(bar(e, t0, total));
    const label = threads.get(`${lane.pid}:${lane.tid}`) || `lane ${lane.tid}`;
    inner.append(h('div', { class: 'wf-row' }, h('span', { class: 'wf-label', title: label }, label), track));
  }
  wrap.append(h('div', { class: 'wf-scroll', tabindex: '0', role: 'region', 'aria-label': 'Trace lanes (scrolls)' },
    inner));
  return wrap;
}

function cmp(a, b) {
  return a < b ? -1 : a > b ? 1 : 0;
}

function isFailed(e) {
  const status = e.args && e.args.status;
  return FAILED.has(status) || String(e.cat || '').includes('error');
}

function bar(e, t0, total) {
  const args = e.args || {};
  const el = h('div', { class: isFailed(e) ? 'wf-bar failed' : 'wf-bar' });
  el.style.left = `${((e.ts - t0) / total) * 100}%`;
  el.style.width = `${((e.dur || 0) / total) * 100}%`;
  const lines = [e.name, `start +${fmt.seconds((e.ts - t0) / 1e6)}, took ${fmt.seconds((e.dur || 0) / 1e6)}`];
  if (args.item_id !== undefined) lines.push(`item ${args.item_id}`);
  if (args.status !== undefined) lines.push(`status ${args.status}`);
  if (args.attempts !== undefined) lines.push(`attempts ${args.attempts}`);
  el.title = lines.join('\n');
  return el;
}

function axis(total) {
  const step = niceStep(total / 6);
  const track = h('div', { class: 'wf-track', 'aria-hidden': 'true' });
  for (let t = 0; t <= total + 1e-9; t += step) {
    const tick = h('span', { class: 'wf-tick' }, fmt.seconds(t / 1e6));
    tick.style.left = `${(t / total) * 100}%`;
    if (t / total > 0.95 && t > 0) tick.style.transform = 'translateX(-100%)';
    track.append(tick);
  }
  return h('div', { class: 'wf-row wf-axis' }, h('span', { class: 'wf-label' }, 'time'), track);
}

function niceStep(raw) {
  const power = 10 ** Math.floor(Math.log10(Math.max(raw, 1e-9)));
  for (const m of [1, 2, 5, 10]) if (raw <= m * power) return m * power;
  return 10 * power;
}
