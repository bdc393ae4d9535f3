// pages/schedule.js: /console/schedules/{id}: a schedule, a uPlot chart of its runs' scores over time (regressed
// runs marked with a red triangle; a click on a point opens that evaluation) and the table of its runs, each a link
// to its evaluation (the keyboard's way to every point).

import { api } from '../api.js';
import { chartLegend, scoreChart } from '../chart.js';
import { badge, facts, fillTable, h, keepFocus, replace, section, td, to, truncated } from '../dom.js';
import * as fmt from '../format.js';
import { navigate } from '../router.js';

const COLUMNS = ['Run (evaluation)', 'Fire time', { label: 'Version', class: 'num' }, 'Status',
  { label: 'Score', class: 'num' }, { label: 'Previous', class: 'num' }, { label: 'Change', class: 'num' }, 'Regressed'];

export async function render(ctx) {
  const [id] = ctx.params;
  const base = `/v1/evaluations/schedules/${encodeURIComponent(id)}`;
  ctx.title(`Schedule ${id}`);
  const head = h('div');
  const chartBox = h('div', { class: 'chart', 'data-testid': 'schedule-chart', role: 'img' });
  const chartNote = h('div');
  const runsBox = h('div');
  replace(ctx.page, head, section('Score over time', chartBox, chartNote), section('Runs', runsBox));

  const [schedule, runs] = await Promise.all([api(base, { signal: ctx.signal }), api(`${base}/runs`, { signal: ctx.signal })]);
  if (!ctx.alive) return;
  replace(head,
    h('div', { class: 'page-head' }, h('h1', {}, 'Schedule ', h('span', { class: 'mono' }, schedule.id)),
      h('span', { class: 'badge' }, schedule.enabled ? 'enabled' : 'paused')),
    h('div', { class: 'card', 'data-testid': 'schedule-summary' }, facts([
      ['Pipeline', to('pipelines', schedule.pipeline)],
      ['Cron', h('code', {}, schedule.cron)],
      ['Regression margin', fmt.score(schedule.margin)],
      ['Next fire', fmt.time(schedule.next_fire_at)],
      ['Last fire', fmt.time(schedule.last_fire_at)],
      ['Created', fmt.time(schedule.created_at)],
      ['Loss', schedule.loss ? truncated(fmt.lossText(schedule.loss), 80) : null],
    ])));

  let chart = null;
  let shown = '';
  async function draw(view) {
    const data = view.data || [];
    keepFocus(() => fillTable(runsBox, 'runs-table', COLUMNS, data.map(runRow),
      'Runs of the schedule, oldest first', 'No runs yet: the schedule has not fired.'));
    const regressed = data.filter((r) => r.regressed).length;
    const fingerprint = JSON.stringify(data.map((r) => [r.id, r.score, r.regressed]));
    if (fingerprint === shown) return; // nothing new to plot
    shown = fingerprint;
    chartBox.setAttribute('aria-label', `Score over time: ${data.length} runs, ${regressed} regressed. ` +
      'The table of runs below has every point.');
    if (chart) chart.destroy();
    chart = null;
    const scored = data.filter((r) => r.score !== null && r.score !== undefined);
    if (!scored.length) {
      replace(chartBox, h('p', { class: 'muted' }, 'No scored runs yet.'));
      replace(chartNote);
      return;
    }
    const xs = data.map((r) => r.fire_time ?? r.created_at);
    const ys = data.map((r) => r.score ?? null);
    const marked = new Set(data.flatMap((r, i) => (r.regressed ? [i] : [])));
    chart = await scoreChart(chartBox, xs, ys, { time: true, marked, label: 'score', yLabel: 'score',
      onPick: (i) => navigate(`/console/evaluations/${encodeURIComponent(data[i].id)}`) });
    replace(chartNote, chartLegend(`regressed (dropped by more than ${fmt.score(view.margin)})`),
      h('p', { class: 'legend' }, `${regressed} of ${data.length} runs regressed. Click a point to open its evaluation.`));
  }
  ctx.signal.addEventListener('abort', () => chart && chart.destroy());

  await draw(runs);
  const live = (view) => view.data.some((r) => fmt.isLive(r.status));
  const poller = ctx.poller(async () => {
    const view = await api(`${base}/runs`, { signal: ctx.signal });
    if (!ctx.alive) return false;
    await draw(view);
    return live(view);
  });
  if (live(runs)) poller.ensure();
}

function runRow(run) {
  const change = run.score !== null && run.score !== undefined && run.previous_score !== null &&
    run.previous_score !== undefined ? run.score - run.previous_score : null;
  const [changeText, changeClass] = fmt.delta(change);
  const regressed = run.regressed === true;
  return h('tr', { 'data-testid': 'run-row', 'data-regressed': String(regressed), 'data-evaluation-id': run.id,
    class: regressed ? 'regressed' : null },
  td(to('evaluations', run.id), 'id'),
  td(fmt.time(run.fire_time), 'nowrap'),
  td(run.parameter_version ?? '—', 'num'),
  td(badge(run.status), 'nowrap'),
  td(fmt.score(run.score), 'num'),
  td(fmt.score(run.previous_score), 'num'),
  td(h('span', { class: changeClass }, changeText.replace(/ (improved|regressed|unchanged)$/, '')), 'num'),
  td(run.regressed === null || run.regressed === undefined ? '—'
    : regressed ? h('span', { class: 'delta down' }, '▼ regressed') : 'no'));
}
