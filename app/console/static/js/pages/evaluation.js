// pages/evaluation.js: /console/evaluations/{id}: the evaluation's summary, a "Compare with" baseline (another
// evaluation of the same pipeline, by default the one before it) and the examples side by side with the
// baseline's (score deltas, regressions first, a score threshold, pages by offset); a row's Diff button shows its
// output diffed against the target and against the baseline's output.

import { api } from '../api.js';
import { legend, wordDiff } from '../diffview.js';
import { badge, debounce, facts, fillTable, h, keepFocus, labelled, link, offsetPager, replace, section, td, to,
  truncated } from '../dom.js';
import * as fmt from '../format.js';
import { query, setQuery } from '../router.js';
import { datasetText } from './evaluations.js';

const PAGE = 50;
const COLUMNS = [{ label: '#', class: 'num' }, 'Input', 'Target', 'Output', { label: 'Score', class: 'num' },
  { label: 'Baseline', class: 'num' }, { label: 'Change', class: 'num' }, 'Feedback', 'Diff'];

export async function render(ctx) {
  const [id] = ctx.params;
  const base = `/v1/evaluations/${encodeURIComponent(id)}`;
  ctx.title(`Evaluation ${id}`);
  const q = query();
  const state = { baseline: q.baseline || '', regressions: q.order === 'regressions', below: q.below || '',
    offset: Math.max(0, parseInt(q.offset, 10) || 0), open: null };

  const head = h('div');
  const summary = h('div', { class: 'summary', 'data-testid': 'compare-summary' });
  const tableSlot = h('div');
  const pagerSlot = h('div');
  const body = h('div', {}, tableSlot, pagerSlot);
  const baselineSelect = h('select', { name: 'baseline', 'data-testid': 'baseline-select' },
    h('option', { value: 'none' }, 'No baseline'));
  const regressions = h('input', { type: 'checkbox', name: 'regressions_first', checked: state.regressions,
    'data-testid': 'regressions-first' });
  const below = h('input', { type: 'number', name: 'below', step: 'any', value: state.below, placeholder: 'e.g. 0.5',
    'data-testid': 'below-input' });
  const controls = h('form', { class: 'controls', 'aria-label': 'Compare and filter the examples' },
    labelled('Compare with', baselineSelect), h('label', { class: 'check' }, regressions, 'Regressions first'),
    labelled('Score below', below));
  replace(ctx.page, head, section('Examples', controls, summary, body));

  let evaluation = await api(base, { signal: ctx.signal });
  if (!ctx.alive) return;
  drawHead();
  await fillBaselines();

  function drawHead() {
    const progress = evaluation.progress || {};
    replace(head,
      h('div', { class: 'page-head' }, h('h1', {}, 'Evaluation ', h('span', { class: 'mono' }, evaluation.id)),
        badge(evaluation.status)),
      h('div', { class: 'card', 'data-testid': 'evaluation-summary', 'data-status': evaluation.status },
        facts([
          ['Pipeline', to('pipelines', evaluation.pipeline)],
          ['Parameter version', String(evaluation.parameter_version ?? '—')],
          ['Score (mean)', fmt.score(evaluation.score)],
          ['Examples', `${fmt.number(progress.completed_examples)} / ${fmt.number(progress.total_examples)} done`],
          ['Dataset', datasetText(evaluation.dataset)],
          ['Loss', evaluation.loss ? truncated(fmt.lossText(evaluation.loss), 80) : null],
          ['Schedule', evaluation.schedule_id
            ? link(`/console/schedules/${encodeURIComponent(evaluation.schedule_id)}`, evaluation.schedule_id) : null],
          ['Fire time', evaluation.fire_time ? fmt.time(evaluation.fire_time) : null],
          ['Created', fmt.time(evaluation.created_at)],
          ['Duration', fmt.duration(evaluation.started_at, evaluation.finished_at)],
        ]),
        evaluation.error ? h('p', { class: 'error-text' }, `Error: ${fmt.errorText(evaluation.error)}`) : null));
  }

  /** Other evaluations of the pipeline (up to 300, newest first); the default baseline is the one before. */
  async function fillBaselines() {
    const others = [];
    let after = '';
    for (let page = 0; page < 3; page++) {
      const list = await api('/v1/evaluations', { signal: ctx.signal, query: { limit: 100, after } });
      others.push(...list.data.filter((e) => e.pipeline === evaluation.pipeline && e.id !== evaluation.id));
      if (!list.has_more) break;
      after = list.last_id;
    }
    if (!ctx.alive) return;
    const earlier = others.find((e) => e.created_at < evaluation.created_at ||
      (e.created_at === evaluation.created_at && e.id < evaluation.id));
    if (!state.baseline) state.baseline = earlier ? earlier.id : 'none';
    if (state.baseline !== 'none' && !others.some((e) => e.id === state.baseline)) {
      others.unshift({ id: state.baseline, status: '?', created_at: null });
    }
    for (const e of others) {
      const text = `${e.id} · v${e.parameter_version ?? '?'} · score ${fmt.score(e.score)} · ${fmt.time(e.created_at)}` +
        (earlier && e.id === earlier.id ? ' (previous)' : '');
      baselineSelect.append(h('option', { value: e.id }, text));
    }
    baselineSelect.value = state.baseline;
  }

  async function loadExamples() {
    const answer = await api(`${base}/examples`, { signal: ctx.signal, query: {
      baseline: state.baseline === 'none' ? '' : state.baseline, order: state.regressions ? 'regressions' : 'index',
      below: state.below, offset: state.offset, limit: PAGE } });
    if (!ctx.alive) return;
    keepFocus(() => drawExamples(answer));
  }

  function drawExamples(answer) {
    const s = answer.summary || {};
    const hasBaseline = state.baseline !== 'none';
    replace(summary, facts([
      ['Examples', fmt.number(s.count)],
      ['Mean score', fmt.score(s.mean)],
      hasBaseline ? ['Baseline mean', fmt.score(s.baseline_mean)] : [null, null],
      hasBaseline ? ['Paired', fmt.number(s.paired)] : [null, null],
      hasBaseline ? ['Improved', h('span', { class: 'delta up' }, `▲ ${fmt.number(s.improved)}`)] : [null, null],
      hasBaseline ? ['Regressed', h('span', { class: 'delta down' }, `▼ ${fmt.number(s.regressed)}`)] : [null, null],
      hasBaseline ? ['Unchanged', fmt.number(s.unchanged)] : [null, null],
    ], 'compare-facts'));
    const rows = [];
    for (const example of answer.data) {
      const [deltaText, deltaClass] = fmt.delta(example.delta);
      const open = state.open === example.index;
      const toggle = h('button', { type: 'button', class: 'secondary', 'aria-expanded': String(open),
        'data-key': `diff-${example.index}`, 'data-testid': 'diff-button',
        'aria-label': `${open ? 'Hide' : 'Show'} the diffs of example ${example.index}` }, open ? 'Hide' : 'Diff');
      const tr = h('tr', { 'data-testid': 'compare-row', 'data-index': example.index, class: open ? 'selected' : null,
        'data-delta': example.delta === null || example.delta === undefined ? 'none' : Math.sign(example.delta) },
      td(fmt.number(example.index), 'num'),
      td(truncated(fmt.valueText(example.input), 120), 'text'),
      td(truncated(fmt.valueText(example.target), 120), 'text'),
      td(example.error ? h('span', { class: 'error-text' }, truncated(fmt.errorText(example.error), 120))
        : truncated(fmt.valueText(example.output), 120), 'text'),
      td(fmt.score(example.score), 'num'),
      td(example.baseline ? fmt.score(example.baseline.score) : '—', 'num'),
      td(h('span', { class: deltaClass }, deltaText), 'num'),
      td(truncated(fmt.valueText(example.feedback), 100), 'text'),
      td(toggle));
      toggle.addEventListener('click', () => {
        state.open = open ? null : example.index;
        drawExamples(answer);
      });
      rows.push(tr);
      if (open) rows.push(detailRow(example));
    }
    fillTable(tableSlot, 'compare-table', COLUMNS, rows, 'Examples compared with the baseline',
      state.below !== '' ? 'No example scored below this threshold.' : 'No examples yet.');
    replace(pagerSlot, offsetPager({ offset: state.offset, size: PAGE, total: answer.total, hasMore: answer.has_more,
      noun: 'examples', testid: 'examples-pager', goto }));
  }

  function detailRow(example) {
    const box = h('div', { 'data-testid': 'example-diff' }, h('p', { class: 'muted' }, 'Comparing…'));
    const cell = h('td', { colspan: COLUMNS.length }, box);
    (async () => {
      const parts = [h('div', {}, h('h3', {}, 'Output against the target'), legend('the target', 'the output'),
        await wordDiff(example.target, example.output, { 'data-testid': 'diff-target' }))];
      if (example.baseline) {
        parts.push(h('div', {}, h('h3', {}, 'Output against the baseline\'s output'),
          legend('the baseline\'s output', 'this output'),
          await wordDiff(example.baseline.output, example.output, { 'data-testid': 'diff-baseline' })));
      } else {
        parts.push(h('div', {}, h('h3', {}, 'Against the baseline'), h('p', { class: 'muted' },
          hasNoBaseline() ? 'Pick a baseline above to compare with it.' : 'The baseline has no output for this example.')));
      }
      replace(box, h('div', { class: 'diff-grid' }, parts));
    })().catch((err) => replace(box, h('p', { class: 'error-text' }, err.message)));
    return h('tr', { class: 'detail' }, cell);
  }

  const hasNoBaseline = () => state.baseline === 'none';

  function goto(offset) {
    state.offset = offset;
    state.open = null;
    setQuery({ offset: offset || '' });
    loadExamples().catch(ctx.error);
  }

  function refilter() {
    state.baseline = baselineSelect.value;
    state.regressions = regressions.checked;
    state.below = below.value.trim();
    state.offset = 0;
    state.open = null;
    setQuery({ baseline: state.baseline, order: state.regressions ? 'regressions' : '', below: state.below, offset: '' });
    loadExamples().catch(ctx.error);
  }

  baselineSelect.addEventListener('change', refilter);
  regressions.addEventListener('change', refilter);
  below.addEventListener('input', debounce(refilter, 400));
  controls.addEventListener('submit', (event) => {
    event.preventDefault();
    refilter();
  });

  const poller = ctx.poller(async () => {
    evaluation = await api(base, { signal: ctx.signal });
    if (!ctx.alive) return false;
    keepFocus(drawHead);
    await loadExamples();
    return fmt.isLive(evaluation.status);
  });
  await loadExamples();
  if (fmt.isLive(evaluation.status)) poller.ensure();
}
