// router.js: client-side routing on the path (history.pushState). Links stay real <a href> links: a plain
// left click on a console link is handled here, anything else (middle click, modifier keys, reload) is left to
// the browser, which gets the same page from the server.

const BASE = '/console';

const ROUTES = [
  [/^\/jobs$/, 'jobs', () => import('./pages/jobs.js')],
  [/^\/jobs\/([^/]+)$/, 'jobs', () => import('./pages/job.js')],
  [/^\/evaluations$/, 'evaluations', () => import('./pages/evaluations.js')],
  [/^\/evaluations\/([^/]+)$/, 'evaluations', () => import('./pages/evaluation.js')],
  [/^\/schedules$/, 'schedules', () => import('./pages/schedules.js')],
  [/^\/schedules\/([^/]+)$/, 'schedules', () => import('./pages/schedule.js')],
  [/^\/trainings$/, 'trainings', () => import('./pages/trainings.js')],
  [/^\/trainings\/([^/]+)$/, 'trainings', () => import('./pages/training.js')],
  [/^\/pipelines$/, 'pipelines', () => import('./pages/pipelines.js')],
  [/^\/pipelines\/([^/]+)$/, 'pipelines', () => import('./pages/pipeline.js')],
  [/^\/batches$/, 'batches', () => import('./pages/batches.js')],
  [/^\/files$/, 'files', () => import('./pages/files.js')],
];

/** {section, load, params} for a location path, or null for an unknown console page. '' is the home. */
export function match(pathname) {
  let rest = pathname.startsWith(BASE) ? pathname.slice(BASE.length) : pathname;
  if (rest.length > 1 && rest.endsWith('/')) rest = rest.slice(0, -1);
  if (rest === '' || rest === '/') return { section: 'home', load: null, params: [] };
  for (const [pattern, section, load] of ROUTES) {
    const found = pattern.exec(rest);
    if (found) return { section, load, params: found.slice(1).map(decodeURIComponent) };
  }
  return null;
}

let onChange = () => {};

/** Go to a console path (with its query string). */
export function navigate(path, { replace = false } = {}) {
  if (replace) history.replaceState(null, '', path);
  else history.pushState(null, '', path);
  onChange({ focus: !replace });
}

/** The current query string as an object. */
export function query() {
  return Object.fromEntries(new URLSearchParams(location.search));
}

/** Change the query string (filters, paging) without rendering the page again. */
export function setQuery(values, { push = false } = {}) {
  const params = new URLSearchParams(location.search);
  for (const [name, value] of Object.entries(values)) {
    if (value === null || value === undefined || value === '' || value === false) params.delete(name);
    else params.set(name, String(value));
  }
  const qs = params.toString();
  const next = location.pathname + (qs ? `?${qs}` : '');
  if (push) history.pushState(null, '', next);
  else history.replaceState(null, '', next);
}

export function start(render) {
  onChange = render;
  window.addEventListener('popstate', () => render());
  document.addEventListener('click', (event) => {
    if (event.defaultPrevented || event.button !== 0) return;
    if (event.metaKey || event.ctrlKey || event.shiftKey || event.altKey) return;
    const a = event.target.closest && event.target.closest('a[href]');
    if (!a || a.target || a.hasAttribute('download')) return;
    const to = new URL(a.href, location.href);
    if (to.origin !== location.origin) return;
    if (to.pathname !== BASE && !to.pathname.startsWith(`${BASE}/`)) return;
    if (to.pathname.startsWith(`${BASE}/static/`)) return;
    event.preventDefault();
    if (to.pathname + to.search === location.pathname + location.search) return;
    history.pushState(null, '', to.pathname + to.search + to.hash);
    render({ focus: true });
  });
  render();
}
