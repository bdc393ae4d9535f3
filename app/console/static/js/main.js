// main.js: the console's entry point: the sign-in gate (a key in sessionStorage, or none when the server has no
// keys), the navigation bar, and the life of a page (its loading, its errors, its polling, stopped on leaving).

import { ApiError, clearKey, getKey, onUnauthorized, request, setKey } from './api.js';
import { alertBox, h, replace } from './dom.js';
import { match, navigate, start } from './router.js';

const page = document.getElementById('page');
const alerts = document.getElementById('alerts');
const nav = document.getElementById('nav');
const signOut = document.getElementById('sign-out');

let current = null; // the AbortController of the page on screen
let open = null; // true: the server has no API keys (it answered without one); null: not asked yet
let seq = 0;

const NAME = 'inf-engine console';

async function render({ focus = false } = {}) {
  const mine = ++seq;
  if (current) current.abort();
  const controller = new AbortController();
  current = controller;
  replace(alerts);
  if (!getKey() && open !== true) {
    const probe = await probeOpen();
    if (mine !== seq) return;
    open = probe.open;
    if (!open) {
      showSignIn(probe.error);
      return;
    }
  }
  const route = match(location.pathname);
  if (route && route.section === 'home') {
    navigate('/console/jobs', { replace: true });
    return;
  }
  showNav(route ? route.section : null);
  if (!route) {
    document.title = `Page not found · ${NAME}`;
    replace(page, h('h1', { tabindex: '-1' }, 'Page not found'),
      h('p', {}, 'There is no console page at ', h('code', {}, location.pathname), '. ',
        h('a', { href: '/console/jobs' }, 'Go to the jobs'), '.'));
    if (focus) focusHeading();
    return;
  }
  replace(page, h('p', { class: 'muted' }, 'Loading…'));
  const ctx = context(controller, route.params);
  let module;
  try {
    module = await route.load();
  } catch (err) {
    if (mine === seq) ctx.error(new Error(`This page could not be loaded (${err.message}). Reload to try again.`));
    return;
  }
  if (mine !== seq) return;
  try {
    await module.render(ctx);
  } catch (err) {
    if (mine === seq) {
      ctx.error(err);
      // the page's resource does not exist (or is another tenant's): its empty sections would only mislead
      if (err instanceof ApiError && err.status === 404) replace(page);
    }
  }
  if (focus && mine === seq) focusHeading();
}

function focusHeading() {
  const heading = page.querySelector('h1');
  if (heading) {
    heading.setAttribute('tabindex', '-1');
    heading.focus();
  } else {
    document.getElementById('main').focus();
  }
}

/** What a page gets: its params, its element, an abort signal (the page was left), error display, polling. */
function context(controller, params) {
  const ctx = {
    params,
    page,
    signal: controller.signal,
    get alive() {
      return !controller.signal.aborted;
    },
    title(text) {
      document.title = `${text} · ${NAME}`;
    },
    error(err) {
      if (!err || err.name === 'AbortError' || controller.signal.aborted) return;
      if (err instanceof ApiError && err.status === 401) return; // the sign-in form is on screen
      replace(alerts, alertBox(err.message || String(err)));
      if (page.textContent.trim() === 'Loading…') replace(page);
    },
    clearError() {
      if (!controller.signal.aborted) replace(alerts);
    },
    /** A poll loop: fn runs every `ms` until it returns false or the page is left; ensure() (re)starts it. */
    poller(fn, ms = 1500) {
      let timer = null;
      const tick = async () => {
        timer = null;
        if (controller.signal.aborted) return;
        let again = true;
        try {
          if (!document.hidden) again = await fn(); // a hidden tab asks nothing, and catches up when shown
        } catch (err) {
          ctx.error(err);
          if (err instanceof ApiError && err.status === 401) return;
        }
        if (again !== false && !controller.signal.aborted && timer === null) timer = setTimeout(tick, ms);
      };
      controller.signal.addEventListener('abort', () => clearTimeout(timer));
      return {
        ensure() {
          if (timer === null && !controller.signal.aborted) timer = setTimeout(tick, ms);
        },
      };
    },
  };
  return ctx;
}

async function probeOpen() {
  try {
    await request('/v1/jobs', { query: { limit: 1 }, key: null, quiet401: true });
    return { open: true };
  } catch (err) {
    if (err instanceof ApiError && (err.status === 401 || err.status === 403)) return { open: false };
    return { open: false, error: err.message };
  }
}

function showNav(section) {
  nav.hidden = false;
  signOut.hidden = !getKey();
  for (const a of nav.querySelectorAll('a[data-section]')) {
    if (a.dataset.section === section) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
}

function showSignIn(problem, again = false) {
  if (current) current.abort();
  nav.hidden = true;
  document.title = `Sign in · ${NAME}`;
  const input = h('input', { type: 'password', id: 'api-key', name: 'api-key', autocomplete: 'current-password',
    required: true, spellcheck: 'false', 'aria-describedby': 'sign-in-help sign-in-error' });
  const error = h('p', { id: 'sign-in-error', class: 'alert error', role: 'alert', hidden: true });
  const button = h('button', { type: 'submit', id: 'sign-in' }, 'Sign in');
  const form = h('form', { class: 'card sign-in', 'data-testid': 'sign-in-form', novalidate: true },
    h('h1', {}, 'Sign in'),
    h('p', { id: 'sign-in-help' }, again
      ? 'Your API key was not accepted any more. Sign in again with a valid key.'
      : 'Enter an API key of this server. It is kept in this browser tab only (session storage) and is sent ' +
        'to this server\'s /v1 API, nothing else.'),
    h('label', { for: 'api-key' }, 'API key'),
    input, error, button);
  const fail = (message) => {
    error.textContent = message;
    error.hidden = false;
    input.setAttribute('aria-invalid', 'true');
    input.focus();
  };
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    const key = input.value.trim();
    if (!key) {
      fail('Enter an API key.');
      return;
    }
    button.disabled = true;
    try {
      await request('/v1/jobs', { query: { limit: 1 }, key, quiet401: true });
    } catch (err) {
      button.disabled = false;
      fail(err.status === 401 || err.status === 403 ? 'That API key was not accepted' : err.message);
      return;
    }
    setKey(key);
    open = false;
    const route = match(location.pathname);
    if (!route || route.section === 'home') navigate('/console/jobs');
    else render({ focus: true });
  });
  replace(alerts, problem ? alertBox(problem) : null);
  replace(page, form);
  input.focus();
}

onUnauthorized(() => {
  const had = Boolean(getKey());
  clearKey();
  open = false;
  seq++;
  showSignIn(null, had);
});

signOut.addEventListener('click', () => {
  clearKey();
  open = null;
  navigate('/console');
});

start(render);
