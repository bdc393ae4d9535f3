// pages/job.js: /console/jobs/{id}: the job's header (status, progress, usage, times, Cancel), its items table
// (search, status filter, failures first, pages by offset, JSONL/CSV downloads) and its trace as a waterfall.
// While the job runs, the header and the first page of items refresh every 1.5 s.

import { api, download } from '../api.js';
import { cancelJob } from '../actions.js';
import { alertBox, badge, debounce, facts, fillTable, h, keepFocus, labelled, offsetPager, progress, replace, section,
  select, td, truncated } from '../dom.js';
import * as fmt from '../format.js';
import { query, setQuery } from '../router.js';
import { drawTrace } from '../trace.js';

const PAGE = 50;
const ITEM_STATUSES = ['pending', 'running', 'completed', 'failed', 'cancelled'];
const COLUMNS = [{ label: '#', class: 'num' }, 'Custom id', 'Status', 'Input', 'Output or error',
  { label: 'Latency', class: 'num' }, 'Finished'];

export async function render(ctx) {
  const [id] = ctx.params;
  const base = `/v1/jobs/${encodeURIComponent(id)}`;
  ctx.title(`Job ${id}`);
  const q = query();
  const state = { q: q.q || '', status: q.status || '', failures: q.order === 'failures_first',
    offset: Math.max(0, parseInt(q.offset, 10) || 0) };

  const head = h('div');
  const itemsTable = h('div');
  const itemsPager = h('div');
  const itemsBody = h('div', {}, itemsTable, itemsPager);
  const traceBody = h('div', { class: 'muted' }, 'Loading the trace…');
  const search = h('input', { type: 'search', name: 'q', value: state.q, placeholder: 'Text in id, input, output',
    autocomplete: 'off' });
  const statusSelect = select('status', [['', 'Any status'], ...ITEM_STATUSES.map((s) => [s, s])], state.status);
  const failures = h('input', { type: 'checkbox', name: 'failures_first', checked: state.failures,
    'data-testid': 'failures-first' });
  const downloads = ['jsonl', 'csv'].map((format) => h('button', { type: 'button', class: 'secondary',
    'data-testid': `download-${format}`, onclick: () => exportItems(format) }, `Download ${format.toUpperCase()}`));
  const controls = h('form', { class: 'controls', role: 'search', 'aria-label': 'Filter the items' },
    labelled('Search', search), labelled('Status', statusSelect),
    h('label', { class: 'check' }, failures, 'Failures first'),
    h('span', { class: 'spacer' }), ...downloads);
  const traceButton = h('button', { type: 'button', class: 'secondary', 'data-testid': 'download-trace',
    onclick: () => download(`${base}/trace`, {}, `${id}.trace.json`).catch(ctx.error) }, 'Download trace JSON');
  replace(ctx.page, head, section('Items', controls, itemsBody),
    section('Trace', h('p', { class: 'legend' }, 'One bar per node run, on lanes that never overlap; open the JSON in ',
      'Perfetto or chrome://tracing for every detail. ', traceButton), traceBody));

  let job = null;
  let traceShownFor = null; // the job status the trace was drawn at
  let polls = 0;

  const filters = () => ({ status: state.status, q: state.q, order: state.failures ? 'failures_first' : '' });

  async function loadJob() {
    job = await api(base, { signal: ctx.signal });
    if (!ctx.alive) return;
    keepFocus(() => drawHead());
  }

  async function loadItems() {
    const page = await api(`${base}/items`, { signal: ctx.signal,
      query: { ...filters(), order: state.failures ? 'failures_first' : 'position', offset: state.offset, limit: PAGE } });
    if (!ctx.alive) return;
    keepFocus(() => drawItems(page));
  }

  async function loadTrace() {
    if (job && !job.started_at) { // nothing ran yet: the trace route would answer 404
      replace(traceBody, h('p', { class: 'muted', 'data-testid': 'no-trace' }, 'No trace yet: the job has not started.'));
      traceShownFor = job.status;
      return;
    }
    try {
      const trace = await api(`${base}/trace`, { signal: ctx.signal });
      if (!ctx.alive) return;
      replace(traceBody, drawTrace(trace));
      traceBody.classList.remove('muted');
    } catch (err) {
      if (err.status === 404) {
        replace(traceBody, h('p', { class: 'muted', 'data-testid': 'no-trace' }, 'No trace yet: the job has not started.'));
      } else if (err.name !== 'AbortError' && ctx.alive) {
        replace(traceBody, alertBox(err.message));
      }
    }
    traceShownFor = job ? job.status : null;
  }

  function drawHead() {
    const [done, total] = fmt.doneOf(job.counts);
    const usage = job.usage || {};
    const counts = job.counts || {};
    const cancel = fmt.canCancel(job.status)
      ? h('button', { type: 'button', class: 'danger', 'data-testid': 'cancel-job', 'data-key': 'cancel',
        onclick: async () => { if (await cancelJob(id, ctx)) refresh(); } }, 'Cancel job')
      : null;
    replace(head,
      h('div', { class: 'page-head' }, h('h1', {}, 'Job ', h('span', { class: 'mono' }, job.id)), badge(job.status), cancel),
      h('div', { class: 'card', 'data-testid': 'job-header', 'data-status': job.status },
        h('p', {}, progress(done, total), ' ',
          h('span', { class: 'muted' }, `${fmt.number(counts.completed)} completed, ${fmt.number(counts.failed)} failed, ` +
            `${fmt.number(counts.cancelled)} cancelled, ${fmt.number(counts.pending)} pending`)),
        facts([
          ['Pipeline', job.pipeline],
          ['Priority', String(job.priority ?? '—')],
          ['Tokens', `${fmt.number(usage.total_tokens)} (${fmt.number(usage.input_tokens)} in, ${fmt.number(usage.output_tokens)} out)`],
          ['Cost', fmt.cost(usage.cost)],
          ['LLM calls', fmt.number(usage.llm_calls)],
          ['Latency (avg / max)', usage.llm_calls ? `${fmt.ms(usage.latency_ms_avg)} / ${fmt.ms(usage.latency_ms_max)}` : null],
          ['Created', fmt.time(job.created_at)],
          ['Started', fmt.time(job.started_at)],
          ['Finished', fmt.time(job.finished_at)],
          ['Duration', fmt.duration(job.started_at, job.finished_at)],
          ['Input file', job.input_file_id],
          ['Metadata', job.metadata && Object.keys(job.metadata).length ? truncated(fmt.valueText(job.metadata), 120) : null],
        ], 'job-facts'),
        job.error ? h('p', { class: 'error-text' }, `Error: ${fmt.errorText(job.error)}`) : null));
  }

  function drawItems(page) {
    const rows = page.data.map((item) => h('tr', { 'data-testid': 'item-row', 'data-custom-id': item.custom_id,
      'data-status': item.status },
    td(fmt.number(item.position), 'num'),
    td(item.custom_id, 'cid'),
    td(badge(item.status), 'nowrap'),
    td(truncated(fmt.valueText(item.input)), 'text'),
    td(item.status === 'failed' || item.error
      ? h('span', { class: 'error-text' }, truncated(fmt.errorText(item.error)))
      : truncated(fmt.valueText(item.output)), 'text'),
    td(fmt.ms(item.latency_ms), 'num'),
    td(fmt.time(item.finished_at), 'nowrap')));
    fillTable(itemsTable, 'items-table', COLUMNS, rows, 'Items of the job',
      state.q || state.status ? 'No items match these filters.' : 'This job has no items.');
    replace(itemsPager, offsetPager({ offset: state.offset, size: PAGE, total: page.total, hasMore: page.has_more,
      noun: 'items', testid: 'items-pager', goto }));
  }

  function goto(offset) {
    state.offset = offset;
    setQuery({ offset: offset || '' });
    loadItems().catch(ctx.error);
  }

  function refilter() {
    state.q = search.value.trim();
    state.status = statusSelect.value;
    state.failures = failures.checked;
    state.offset = 0;
    setQuery({ ...filters(), offset: '' });
    loadItems().catch(ctx.error);
  }

  async function exportItems(format) {
    try {
      await download(`${base}/items/export`, { format, ...filters() }, `${id}.items.${format}`);
    } catch (err) {
      ctx.error(err);
    }
  }

  async function refresh() {
    const before = job ? job.status : null;
    await loadJob();
    if (state.offset === 0) await loadItems();
    const live = fmt.isLive(job.status);
    polls += 1;
    // the trace: when the job starts or ends, and every 4th poll while it runs
    if (job.status !== before || (live && polls % 4 === 0) || (!live && traceShownFor !== job.status)) await loadTrace();
    ctx.clearError();
    return live;
  }

  search.addEventListener('input', debounce(refilter, 300));
  statusSelect.addEventListener('change', refilter);
  failures.addEventListener('change', refilter);
  controls.addEventListener('submit', (event) => {
    event.preventDefault();
    refilter();
  });

  const poller = ctx.poller(refresh);
  await loadJob();
  await Promise.all([loadItems().catch(ctx.error), loadTrace()]);
  if (fmt.isLive(job.status)) poller.ensure();
}
