// listing.js: a list page over a cursor-paged /v1 list ({data, last_id, has_more}): a heading, a table, 50 rows
// a page with Next/Previous (a stack of `after` cursors; `after` is kept in the query string), and polling while a
// row is still live.

import { api } from './api.js';
import { fillTable, h, keepFocus, pager, replace } from './dom.js';
import { query, setQuery } from './router.js';

const PAGE = 50;

/**
 * options: title, intro (nodes), path, testid, columns, row(item) → <tr>, empty (text), caption,
 * live(item) → bool (poll every 1.5 s while one is), query (extra query values), paged (false: one call).
 */
export async function cursorList(ctx, options) {
  ctx.title(options.title);
  const state = { after: options.paged === false ? '' : query().after || '', stack: [] };
  if (state.after) state.stack.push('');
  const tableSlot = h('div');
  const pagerSlot = h('div');
  const body = h('div', {}, tableSlot, pagerSlot);
  replace(ctx.page, h('div', { class: 'page-head' }, h('h1', {}, options.title)), options.intro || null, body);
  let view = null;

  const poller = ctx.poller(async () => {
    await load();
    return live();
  });
  const live = () => Boolean(options.live && view && view.data.some(options.live));

  async function load() {
    const q = options.paged === false ? { ...options.query } : { limit: PAGE, after: state.after, ...options.query };
    view = await api(options.path, { signal: ctx.signal, query: q });
    if (!ctx.alive) return;
    ctx.clearError();
    keepFocus(draw);
    if (live()) poller.ensure();
  }

  function draw() {
    const rows = view.data.map(options.row);
    const paging = options.paged === false ? null : pager({
      label: `Page ${state.stack.length + 1}`, hasPrev: state.stack.length > 0, hasNext: Boolean(view.has_more),
      onPrev: () => go(state.stack.pop() ?? ''),
      onNext: () => {
        state.stack.push(state.after);
        go(view.last_id);
      },
    });
    fillTable(tableSlot, options.testid, options.columns, rows, options.caption || options.title, options.empty);
    replace(pagerSlot, paging);
  }

  function go(after) {
    state.after = after || '';
    setQuery({ after: state.after });
    load().catch(ctx.error);
  }

  await load();
  return { reload: () => load().catch(ctx.error) };
}
