// pages/training.js: /console/trainings/{id}: a training's summary, a uPlot chart of the score at each step, and
// for each step the parameter updates: old and new value as a word diff, the feedback that caused the update, and
// the feedback items behind it (folded in <details>). Refreshes while the training runs.

import { api } from '../api.js';
import { chartLegend, scoreChart } from '../chart.js';
import { legend, wordDiff } from '../diffview.js';
import { badge, facts, h, link, progress, replace, section, to, truncated } from '../dom.js';
import * as fmt from '../format.js';
import { candidatesTable } from './candidates.js';
import { versions } from './trainings.js';

export async function render(ctx) {
  const [id] = ctx.params;
  const base = `/v1/trainings/${encodeURIComponent(id)}`;
  ctx.title(`Training ${id}`);
  const head = h('div');
  const chartBox = h('div', { class: 'chart', 'data-testid': 'training-chart', role: 'img' });
  const chartNote = h('div');
  const stepsBox = h('div', { 'data-testid': 'training-steps' });
  const candidatesBox = h('div', { 'data-testid': 'training-candidates' });
  replace(ctx.page, head, section('Score per step', chartBox, chartNote), candidatesBox,
    section('Steps and updates', stepsBox));

  let chart = null;
  let shown = '';
  ctx.signal.addEventListener('abort', () => chart && chart.destroy());

  async function draw(t) {
    const p = t.progress || {};
    replace(head,
      h('div', { class: 'page-head' }, h('h1', {}, 'Training ', h('span', { class: 'mono' }, t.id)), badge(t.status)),
      h('div', { class: 'card', 'data-testid': 'training-summary', 'data-status': t.status },
        h('p', {}, progress(p.completed_steps, p.total_steps, 'training-progress'), ' ', h('span', { class: 'muted' }, 'steps')),
        facts([
          ['Pipeline', to('pipelines', t.pipeline)],
          ['Versions', versions(t)],
          ['Epochs', String(t.epochs ?? '—')],
          ['Batch size', String(t.batch_size ?? '—')],
          ['Loss', t.loss ? fmt.lossText(t.loss) : null],
          ['Optimizer', t.optimizer ? (t.optimizer.type || truncated(fmt.valueText(t.optimizer), 60)) : null],
          ['Created', fmt.time(t.created_at)],
          ['Duration', fmt.duration(t.started_at, t.finished_at)],
        ]),
        t.error ? h('p', { class: 'error-text' }, `Error: ${fmt.errorText(t.error)}`) : null));
    const steps = t.steps || [];
    const candidates = candidatesTable(t.candidates);
    replace(candidatesBox, candidates ? section('Candidates', h('p', { class: 'muted' },
      'Each candidate is scored on a minibatch against its parent; accepted only when its gain beats the noise, then ' +
      'scored on the validation set. The best by validation score is the version activated.'), candidates) : null);
    const fingerprint = JSON.stringify([steps.map((s) => [s.step, s.score, (s.updates || []).length]),
      t.result && t.result.val_scores]);
    if (fingerprint === shown) return;
    shown = fingerprint;
    chartBox.setAttribute('aria-label', `Score per step: ${steps.length} steps` +
      (steps.length ? `, from ${fmt.score(steps[0].score)} to ${fmt.score(steps[steps.length - 1].score)}` : ''));
    if (chart) chart.destroy();
    chart = null;
    // a selection-gated training's line is its best validation score after each step (what it activates); an SFA
    // training's is the score of each step's batch
    const best = t.result && Array.isArray(t.result.val_scores) ? t.result.val_scores : null;
    if (best && best.length) {
      chart = await scoreChart(chartBox, best.map((_, i) => i), best,
        { xLabel: 'step', yLabel: 'validation score', label: 'best validation score' });
      replace(chartNote, chartLegend(null));
    } else if (steps.length) {
      chart = await scoreChart(chartBox, steps.map((s) => s.step), steps.map((s) => s.score ?? null),
        { xLabel: 'step', yLabel: 'score', label: 'score' });
      replace(chartNote, chartLegend(null));
    } else {
      replace(chartBox, h('p', { class: 'muted' }, 'No steps yet.'));
    }
    const cards = [];
    for (const step of steps) cards.push(await stepCard(step, t.pipeline));
    replace(stepsBox, cards.length ? cards : h('p', { class: 'muted' }, 'No steps yet.'));
  }

  const first = await api(base, { signal: ctx.signal });
  if (!ctx.alive) return;
  await draw(first);
  const poller = ctx.poller(async () => {
    const t = await api(base, { signal: ctx.signal });
    if (!ctx.alive) return false;
    await draw(t);
    return fmt.isLive(t.status);
  });
  if (fmt.isLive(first.status)) poller.ensure();
}

async function stepCard(step, pipeline) {
  const updates = step.updates || [];
  const items = [];
  for (const update of updates) {
    const feedbackItems = update.feedback_items || [];
    items.push(h('article', { class: 'update', 'data-testid': 'update-diff', 'data-name': update.name },
      h('h4', {}, update.name, update.changed === false ? h('span', { class: 'muted' }, ' (unchanged)') : null),
      legend('the old value', 'the new value'),
      await wordDiff(update.old_value, update.new_value),
      update.feedback ? h('div', { class: 'feedback' }, h('strong', {}, 'Feedback: '),
        h('span', { class: 'value' }, fmt.valueText(update.feedback))) : null,
      feedbackItems.length ? h('details', {}, h('summary', {}, `The ${feedbackItems.length} feedback items behind it`),
        h('ul', { class: 'plain' }, feedbackItems.map((item) => h('li', {}, fmt.valueText(item))))) : null,
      update.error ? h('p', { class: 'error-text' }, `Error: ${fmt.errorText(update.error)}`) : null));
  }
  const errors = step.errors && (Array.isArray(step.errors) ? step.errors.length : Object.keys(step.errors).length);
  return h('div', { class: 'step', 'data-testid': 'training-step', 'data-step': step.step },
    h('h3', {}, `Step ${step.step}`, h('span', { class: 'muted' },
      ` · epoch ${step.epoch ?? '—'}, batch ${step.batch ?? '—'} · score ${fmt.score(step.score)}` +
      (step.version ? ' · ' : '')),
    step.version ? link(`/console/pipelines/${encodeURIComponent(pipeline)}?to=${step.version}`, `version ${step.version}`)
      : null),
    errors ? h('p', { class: 'error-text' }, `${errors} errors in this step`) : null,
    items.length ? items : h('p', { class: 'muted' }, 'No parameter updates in this step.'));
}
