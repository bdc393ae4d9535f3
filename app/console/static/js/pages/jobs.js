// pages/jobs.js: /console/jobs: the jobs, newest first, filtered by status and pipeline (kept in the query
// string), 50 a page with a cursor stack for Previous, Cancel, and live progress: the first page is polled every
// 1.5 s (new jobs appear), a later page while a job on it runs.

import { api } from '../api.js';
import { badge, debounce, fillTable, h, keepFocus, labelled, pager, progress, replace, select, td, to } from '../dom.js';
import * as fmt from '../format.js';
import { query, setQuery } from '../router.js';
import { cancelJob } from '../actions.js';

const PAGE = 50;
const STATUSES = ['queued', 'running', 'cancelling', 'completed', 'failed', 'cancelled'];
const COLUMNS = ['Job', 'Pipeline', 'Status', 'Progress', { label: 'Tokens', class: 'num' },
  { label: 'Cost', class: 'num' }, { label: 'Duration', class: 'num' }, 'Created', { label: 'Actions' }];

export async function render(ctx) {
  ctx.title('Jobs');
  const q = query();
  const state = { status: q.status || '', pipeline: q.pipeline || '', after: q.after || '', stack: [] };
  if (state.after) state.stack.push(''); // reloaded on a later page: Previous goes back to the first

  const statusSelect = select('status', [['', 'Any status'], ...STATUSES.map((s) => [s, s])], state.status);
  const pipelineInput = h('input', { type: 'search', name: 'pipeline', value: state.pipeline,
    placeholder: 'e.g. sentiment', autocomplete: 'off' });
  const filters = h('form', { class: 'controls', role: 'search', 'aria-label': 'Filter the jobs' },
    labelled('Status', statusSelect), labelled('Pipeline', pipelineInput));
  const tableSlot = h('div');
  const pagerSlot = h('div');
  const body = h('div', {}, tableSlot, pagerSlot);
  replace(ctx.page, h('div', { class: 'page-head' }, h('h1', {}, 'Jobs')), filters, body);

  let view = null;
  // the first page refreshes all the time (new jobs appear on it), a later one while a job on it is live
  const watching = () => !state.after || view.data.some((job) => fmt.isLive(job.status));
  const poller = ctx.poller(async () => {
    await load();
    return watching();
  });

  async function load() {
    const answer = await api('/v1/jobs', { signal: ctx.signal, query: {
      limit: PAGE, after: state.after, status: state.status, pipeline: state.pipeline } });
    if (!ctx.alive) return;
    // the pipeline filter also applies here, in case the server does not filter by pipeline
    const wanted = state.pipeline.trim();
    view = { ...answer, data: answer.data.filter((job) => !wanted || job.pipeline === wanted) };
    ctx.clearError();
    keepFocus(() => draw());
    if (watching()) poller.ensure();
  }

  function draw() {
    const rows = view.data.map((job) => row(job, reload, ctx));
    fillTable(tableSlot, 'jobs-table', COLUMNS, rows, 'Jobs, newest first', state.status || state.pipeline
      ? 'No jobs match these filters.' : 'No jobs yet. Submit one with POST /v1/jobs.');
    const page = state.stack.length + 1;
    replace(pagerSlot, pager({ label: `Page ${page}`, hasPrev: state.stack.length > 0, hasNext: view.has_more,
        onPrev: () => go(state.stack.pop() ?? ''), onNext: () => { state.stack.push(state.after); go(view.last_id); } }));
  }

  function go(after) {
    state.after = after || '';
    setQuery({ after: state.after });
    reload();
  }

  function reload() {
    load().catch(ctx.error);
  }

  const refilter = () => {
    state.status = statusSelect.value;
    state.pipeline = pipelineInput.value.trim();
    state.after = '';
    state.stack = [];
    setQuery({ status: state.status, pipeline: state.pipeline, after: '' });
    reload();
  };
  statusSelect.addEventListener('change', refilter);
  pipelineInput.addEventListener('input', debounce(refilter, 350));
  filters.addEventListener('submit', (event) => {
    event.preventDefault();
    refilter();
  });

  await load();
}

function row(job, reload, ctx) {
  const [done, total] = fmt.doneOf(job.counts);
  const usage = job.usage || {};
  const actions = fmt.canCancel(job.status)
    ? h('button', { type: 'button', class: 'danger', 'data-key': `cancel-${job.id}`, 'data-testid': 'cancel-job',
      'aria-label': `Cancel job ${job.id}`, onclick: () => cancelJob(job.id, ctx).then((ok) => ok && reload()) }, 'Cancel')
    : null;
  return h('tr', { 'data-testid': 'job-row', 'data-job-id': job.id, 'data-status': job.status },
    td(to('jobs', job.id), 'id'),
    td(job.pipeline),
    td(badge(job.status), 'nowrap'),
    td(progress(done, total), 'nowrap'),
    td(fmt.number(usage.total_tokens), 'num'),
    td(fmt.cost(usage.cost), 'num'),
    td(fmt.duration(job.started_at, job.finished_at), 'num'),
    td(fmt.time(job.created_at), 'nowrap'),
    td(actions, 'nowrap'));
}
