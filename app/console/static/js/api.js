// api.js: every call to the public /v1 API goes through here: the key from sessionStorage as a Bearer token,
// the error body's message as the error, a 401 sends the user to the sign-in form, downloads saved as Blobs.

const KEY = 'inf-engine.console.api-key';

export function getKey() {
  try {
    return sessionStorage.getItem(KEY);
  } catch {
    return null;
  }
}

export function setKey(key) {
  sessionStorage.setItem(KEY, key);
}

export function clearKey() {
  sessionStorage.removeItem(KEY);
}

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

let unauthorized = () => {};

/** What to do when the API answers 401 (main.js shows the sign-in form). */
export function onUnauthorized(fn) {
  unauthorized = fn;
}

/** The path with its query string; empty and null values are left out. */
export function url(path, query = {}) {
  const params = new URLSearchParams();
  for (const [name, value] of Object.entries(query)) {
    if (value !== null && value !== undefined && value !== '') params.set(name, String(value));
  }
  const qs = params.toString();
  return qs ? `${path}?${qs}` : path;
}

/** The raw Response of a /v1 call; throws ApiError on a non-2xx answer. */
export async function request(path, { method = 'GET', query, body, signal, key = getKey(), quiet401 = false } = {}) {
  const headers = { Accept: 'application/json' };
  if (key) headers.Authorization = `Bearer ${key}`;
  const init = { method, headers, signal, cache: 'no-store' };
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(url(path, query), init);
  } catch (err) {
    if (err.name === 'AbortError') throw err;
    throw new ApiError(0, `The server could not be reached (${err.message}).`, null);
  }
  if (response.ok) return response;
  const error = await errorOf(response);
  if (response.status === 401 && !quiet401) unauthorized(error);
  throw error;
}

/** The JSON answer of a /v1 call. */
export async function api(path, options = {}) {
  const response = await request(path, options);
  return response.json();
}

async function errorOf(response) {
  let body = null;
  let message = `The server answered ${response.status} ${response.statusText}`.trim();
  try {
    const text = await response.text();
    try {
      body = JSON.parse(text);
      const found = body && body.error && (body.error.message || body.error);
      if (typeof found === 'string' && found) message = found;
      else if (body && typeof body.detail === 'string') message = body.detail;
    } catch {
      if (text && text.length < 500) message = `${message}: ${text}`;
    }
  } catch {
    /* no body */
  }
  return new ApiError(response.status, message, body);
}

/** Fetch a /v1 download with the key and save it under its Content-Disposition file name (or `fallback`). */
export async function download(path, query, fallback) {
  const response = await request(path, { query });
  const blob = await response.blob();
  const name = fileName(response.headers.get('Content-Disposition')) || fallback;
  const href = URL.createObjectURL(blob);
  const a = document.createElement('a');
  a.href = href;
  a.download = name;
  a.hidden = true;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(href), 60_000);
  return name;
}

function fileName(disposition) {
  if (!disposition) return null;
  const star = /filename\*=(?:UTF-8'')?([^;]+)/i.exec(disposition);
  if (star) {
    try {
      return decodeURIComponent(star[1].trim().replace(/^"|"$/g, ''));
    } catch {
      /* fall through */
    }
  }
  const plain = /filename="?([^";]+)"?/i.exec(disposition);
  return plain ? plain[1] : null;
}
