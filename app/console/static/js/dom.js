// dom.js: small DOM builders. Text goes in through text nodes only (never innerHTML): the values shown are
// other people's data.

/** h('a', {href, class, 'data-testid': x, onclick: fn}, child, ...): an element. Children may be strings,
 *  numbers, nodes, arrays, or null/false (skipped). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith('on') && typeof value === 'function') el.addEventListener(name.slice(2), value);
    else if (name === 'class') el.className = value;
    else if (name in PROPS) el[name] = value;
    else el.setAttribute(name, value === true ? '' : String(value));
  }
  append(el, children);
  return el;
}

const PROPS = { value: 1, checked: 1, selected: 1, disabled: 1, hidden: 1, open: 1, max: 1, min: 1 };

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

/** Replace all children of el. */
export function replace(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

/** An alert banner with the message (role=alert, read out by screen readers). */
export function alertBox(message, kind = 'error') {
  return h('div', { class: `alert ${kind}`, role: 'alert', 'data-testid': 'error-banner' }, message);
}

/** A table inside a horizontally scrolling wrapper. columns: [label | {label, class}]. */
export function table(testid, columns, rows, caption) {
  const head = h('tr', {}, columns.map((c) => h('th', { scope: 'col', class: c.class }, c.label ?? c)));
  const body = h('tbody', {}, rows);
  const t = h('table', { 'data-testid': testid }, caption ? h('caption', { class: 'sr-only' }, caption) : null,
    h('thead', {}, head), body);
  return h('div', { class: 'table-wrap', tabindex: '0', role: 'region', 'aria-label': caption || testid }, t);
}

/** A cell: text that wraps anywhere, optional class. */
export function td(content, cls) {
  return h('td', { class: cls }, content ?? '—');
}

export function link(href, text, attrs = {}) {
  return h('a', { href, ...attrs }, text);
}

/** A link to a console page of a resource: to('jobs', id) → <a href="/console/jobs/{id}">{id}</a>. */
export function to(section, id, text = id) {
  return link(`/console/${section}/${encodeURIComponent(id)}`, text);
}

/** A labelled control: <label>Text <control></label>. */
export function labelled(text, control, cls = 'field') {
  return h('label', { class: cls }, h('span', { class: 'label' }, text), control);
}

export function select(name, options, value, attrs = {}) {
  return h('select', { name, ...attrs },
    options.map(([v, label]) => h('option', { value: v, selected: String(v) === String(value ?? '') }, label)));
}

/** A status word shown as a badge (the word is the information; the colour only repeats it). */
export function badge(status) {
  return h('span', { class: `badge s-${String(status).replace(/[^a-z_]/g, '')}` }, status ?? '—');
}

/** <progress> + "N / M" text. */
export function progress(done, total, testid = 'job-progress') {
  const max = Math.max(total || 0, 1);
  return h('span', { class: 'progress' },
    h('progress', { 'data-testid': testid, max, value: Math.min(done || 0, max),
      'aria-label': `${done || 0} of ${total || 0} done` }),
    h('span', { class: 'progress-text' }, `${done || 0} / ${total || 0}`));
}

/** Long text cut at `limit` characters with a button to show it all (and to fold it again). */
export function truncated(text, limit = 160) {
  text = String(text ?? '');
  if (text.length <= limit) return h('span', { class: 'value' }, text);
  const shown = h('span', { class: 'value' }, text.slice(0, limit) + '…');
  let open = false;
  const button = h('button', { type: 'button', class: 'expand', 'aria-expanded': 'false' }, 'Show all');
  button.addEventListener('click', () => {
    open = !open;
    shown.textContent = open ? text : text.slice(0, limit) + '…';
    button.textContent = open ? 'Show less' : 'Show all';
    button.setAttribute('aria-expanded', String(open));
  });
  return h('span', { class: 'truncated' }, shown, ' ', button);
}

/** A <dl> of [term, value] pairs (null values are skipped). */
export function facts(pairs, testid) {
  const dl = h('dl', { class: 'facts', 'data-testid': testid });
  for (const [term, value] of pairs) {
    if (value === null || value === undefined || value === false) continue;
    dl.append(h('div', {}, h('dt', {}, term), h('dd', {}, value)));
  }
  return dl;
}

/** Runs fn (which re-renders part of the page) and puts the keyboard focus back where it was: on the element
 *  with the same data-key, or the link with the same href (polling must not steal the focus). */
export function keepFocus(fn) {
  const active = document.activeElement;
  let selector = null;
  if (active && active.dataset && active.dataset.key) selector = `[data-key="${CSS.escape(active.dataset.key)}"]`;
  else if (active && active.tagName === 'A') selector = `a[href="${CSS.escape(active.getAttribute('href'))}"]`;
  fn();
  if (selector && !document.contains(active)) {
    const again = document.querySelector(selector);
    if (again) again.focus({ preventScroll: true });
  }
}

/** Puts a table in slot, or only new rows in the table already there (its scroll position and the page's stay);
 *  with no rows, one row saying `empty`. */
export function fillTable(slot, testid, columns, rows, caption, empty = 'Nothing yet.') {
  if (!rows.length) rows = [h('tr', {}, h('td', { class: 'empty', colspan: columns.length }, empty))];
  const existing = slot.querySelector(`table[data-testid="${testid}"]`);
  if (existing) existing.tBodies[0].replaceChildren(...rows);
  else replace(slot, table(testid, columns, rows, caption));
}

/** Prev / next buttons with a label between them. */
export function pager({ label, hasPrev, hasNext, onPrev, onNext, testid = 'pager' }) {
  return h('nav', { class: 'pager', 'aria-label': 'Pages', 'data-testid': testid },
    h('button', { type: 'button', disabled: !hasPrev, onclick: onPrev, 'data-key': `${testid}-prev` }, '← Previous'),
    h('span', { class: 'muted', 'aria-live': 'polite' }, label || ''),
    h('button', { type: 'button', disabled: !hasNext, onclick: onNext, 'data-key': `${testid}-next` }, 'Next →'));
}

/** Pages by offset, with "Page X of Y · N <noun>"; goto(offset) shows another page. */
export function offsetPager({ offset, size, total, hasMore, noun, testid, goto }) {
  const pages = Math.max(1, Math.ceil((total || 0) / size));
  return pager({ label: `Page ${Math.floor(offset / size) + 1} of ${pages} · ${Number(total || 0).toLocaleString('en-US')} ${noun}`,
    hasPrev: offset > 0, hasNext: Boolean(hasMore), testid,
    onPrev: () => goto(Math.max(0, offset - size)), onNext: () => goto(offset + size) });
}

/** fn called at most once per `ms` of quiet (for search boxes). */
export function debounce(fn, ms = 300) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
}

export function section(title, ...children) {
  return h('section', { class: 'card' }, h('h2', {}, title), children);
}
