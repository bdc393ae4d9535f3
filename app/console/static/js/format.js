// format.js: how values are written on the pages (times, durations, numbers, scores, JSON values, statuses).

/** Job and run statuses that still change (JobStatus / RunStatus in app/db/models.py). */
export const LIVE = new Set(['queued', 'running', 'cancelling', 'validating', 'in_progress', 'finalizing']);
export const isLive = (status) => LIVE.has(status);
export const canCancel = (status) => status === 'queued' || status === 'running';

const pad = (n) => String(n).padStart(2, '0');

/** Unix seconds → "2026-11-28 09:22:29" in the browser's time zone. */
export function time(unix) {
  if (unix === null || unix === undefined) return '—';
  const d = new Date(unix * 1000);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

/** Seconds → "850 ms", "12.3 s", "4 min 05 s", "2 h 03 min". */
export function seconds(s) {
  if (s === null || s === undefined || !isFinite(s)) return '—';
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 60) return `${s.toFixed(1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${pad(Math.floor(s % 60))} s`;
  return `${Math.floor(s / 3600)} h ${pad(Math.floor((s % 3600) / 60))} min`;
}

/** From started_at to finished_at (or now while it runs). */
export function duration(started, finished) {
  if (!started) return '—';
  const end = finished ?? Date.now() / 1000;
  return seconds(Math.max(0, end - started));
}

export function ms(value) {
  return value === null || value === undefined ? '—' : seconds(value / 1000);
}

export function number(n) {
  return n === null || n === undefined ? '—' : Number(n).toLocaleString('en-US');
}

export function cost(c) {
  if (c === null || c === undefined) return '—';
  if (c === 0) return '0';
  return Number(c).toPrecision(4).replace(/\.?0+$/, '').replace(/\.?0+e/, 'e');
}

export function score(s) {
  return s === null || s === undefined ? '—' : Number(s).toFixed(3);
}

export function bytes(n) {
  if (n === null || n === undefined) return '—';
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KB`;
  return `${(n / 1024 / 1024).toFixed(1)} MB`;
}

/** Any value as text: strings as they are, everything else as JSON. */
export function valueText(v) {
  if (v === null || v === undefined) return '';
  if (typeof v === 'string') return v;
  try {
    return JSON.stringify(v);
  } catch {
    return String(v);
  }
}

/** Pretty JSON for parameter values (strings stay as they are). */
export function prettyValue(v) {
  if (v === null || v === undefined) return '';
  return typeof v === 'string' ? v : JSON.stringify(v, null, 2);
}

/** A score change as [text, className]: the marker word/arrow says it without colour. */
export function delta(d) {
  if (d === null || d === undefined) return ['—', 'delta none'];
  if (d > 1e-12) return [`▲ +${d.toFixed(3)} improved`, 'delta up'];
  if (d < -1e-12) return [`▼ ${d.toFixed(3)} regressed`, 'delta down'];
  return ['= 0 unchanged', 'delta same'];
}

/** "N / M" done of a job's counts. */
export function doneOf(counts) {
  counts = counts || {};
  return [(counts.completed || 0) + (counts.failed || 0) + (counts.cancelled || 0), counts.total || 0];
}

/** An error value as one line: "Type: message (node X)" for the API's error objects, else as text. */
export function errorText(e) {
  if (e && typeof e === 'object' && typeof e.message === 'string') {
    return `${e.type ? `${e.type}: ` : ''}${e.message}${e.node ? ` (node ${e.node})` : ''}`;
  }
  return valueText(e);
}

/** A loss or metric spec ({"type": "verifier", "check": "exact"}) in a few words. */
export function lossText(loss) {
  if (loss && typeof loss === 'object' && loss.type) {
    const detail = loss.check || loss.metric || loss.name;
    return detail ? `${loss.type} (${typeof detail === 'string' ? detail : valueText(detail)})` : loss.type;
  }
  return valueText(loss);
}
