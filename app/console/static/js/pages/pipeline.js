// pages/pipeline.js: /console/pipelines/{name}: the parameter versions of a pipeline (score, source, training),
// the difference between two chosen versions (a word diff per parameter), and Activate (roll the tenant's active
// parameters to a version) after a confirmation dialog.

import { api } from '../api.js';
import { legend, wordDiff } from '../diffview.js';
import { fillTable, h, keepFocus, labelled, link, replace, section, td, truncated } from '../dom.js';
import * as fmt from '../format.js';
import { query, setQuery } from '../router.js';

const COLUMNS = [{ label: 'Version', class: 'num' }, 'State', { label: 'Score', class: 'num' }, 'Source', 'Training',
  'Note', 'Created', 'Actions'];

export async function render(ctx) {
  const [name] = ctx.params;
  const base = `/v1/pipelines/${encodeURIComponent(name)}/parameters/versions`;
  ctx.title(`Pipeline ${name}`);
  const q = query();
  const state = { from: q.from || '', to: q.to || '' };
  const status = h('p', { role: 'status', class: 'muted', 'data-testid': 'activate-status' });
  const tableBox = h('div');
  const fromSelect = h('select', { name: 'from', 'data-testid': 'from-select' });
  const toSelect = h('select', { name: 'to', 'data-testid': 'to-select' });
  const diffBox = h('div', { 'data-testid': 'version-diff' });
  const dialog = activateDialog();
  replace(ctx.page,
    h('div', { class: 'page-head' }, h('h1', {}, 'Pipeline ', h('span', { class: 'mono' }, name))),
    section('Parameter versions', status, tableBox),
    section('Compare two versions',
      h('form', { class: 'controls', 'aria-label': 'Versions to compare' },
        labelled('From version', fromSelect), labelled('To version', toSelect)),
      diffBox),
    dialog.element);
  let view = null;

  async function load() {
    view = await api(base, { signal: ctx.signal });
    if (!ctx.alive) return;
    const versions = (view.data || []).slice().sort((a, b) => b.version - a.version);
    keepFocus(() => fillTable(tableBox, 'versions-table', COLUMNS, versions.map(row),
      'Parameter versions, newest first', 'No stored versions yet.'));
    fillSelects(versions);
    await drawDiff();
  }

  function row(v) {
    const activate = v.active ? h('span', { class: 'muted' }, 'Active now')
      : h('button', { type: 'button', class: 'secondary', 'data-testid': 'activate-button', 'data-version': v.version,
        'data-key': `activate-${v.version}`, 'aria-label': `Activate version ${v.version}`,
        onclick: () => confirmActivate(v) }, 'Activate');
    return h('tr', { 'data-testid': 'version-row', 'data-version': v.version, 'data-active': String(Boolean(v.active)) },
      td(`v${v.version}`, 'num'),
      td(v.active ? h('span', { class: 'badge s-completed' }, '● active') : '—', 'nowrap'),
      td(fmt.score(v.score), 'num'),
      td(v.source || '—'),
      td(v.training_id ? h('span', {}, link(`/console/trainings/${encodeURIComponent(v.training_id)}`, v.training_id),
        v.step !== null && v.step !== undefined ? ` step ${v.step}` : '') : '—', 'nowrap'),
      td(truncated(v.note || '', 80), 'text'),
      td(fmt.time(v.created_at), 'nowrap'),
      td(activate, 'nowrap'));
  }

  function fillSelects(versions) {
    const numbers = versions.map((v) => v.version);
    const to = numbers.includes(Number(state.to)) ? Number(state.to) : numbers[0];
    const older = numbers.filter((n) => n < to);
    const from = numbers.includes(Number(state.from)) ? Number(state.from) : (older.length ? older[0] : to);
    for (const [select, value] of [[fromSelect, from], [toSelect, to]]) {
      replace(select, versions.map((v) => h('option', { value: v.version },
        `v${v.version}${v.active ? ' (active)' : ''}${v.score !== null && v.score !== undefined ? ` · score ${fmt.score(v.score)}` : ''}`)));
      if (value !== undefined) select.value = String(value);
    }
  }

  async function drawDiff() {
    const versions = view.data || [];
    const a = versions.find((v) => String(v.version) === fromSelect.value);
    const b = versions.find((v) => String(v.version) === toSelect.value);
    if (!a || !b) {
      replace(diffBox, h('p', { class: 'muted' }, 'Pick two versions.'));
      return;
    }
    const before = a.state || {};
    const after = b.state || {};
    const names = [...new Set([...Object.keys(before), ...Object.keys(after)])].sort();
    const changed = names.filter((n) => JSON.stringify(before[n]) !== JSON.stringify(after[n]));
    const same = names.filter((n) => !changed.includes(n));
    const blocks = [];
    for (const n of changed) {
      blocks.push(h('div', { 'data-testid': 'param-diff', 'data-name': n }, h('h3', { class: 'mono' }, n),
        await wordDiff(before[n], after[n])));
    }
    diffBox.dataset.from = a.version;
    diffBox.dataset.to = b.version;
    replace(diffBox,
      h('p', {}, `From v${a.version} to v${b.version}: ${changed.length} parameter${changed.length === 1 ? '' : 's'} changed`,
        same.length ? `, ${same.length} unchanged (${same.join(', ')})` : '', '.'),
      changed.length ? legend(`v${a.version}`, `v${b.version}`) : null,
      blocks);
  }

  function confirmActivate(v) {
    dialog.open(v, name, async () => {
      try {
        await api(`${base}/${v.version}/activate`, { method: 'POST' });
        status.textContent = `Version ${v.version} is now the active version of ${name}.`;
        await load();
      } catch (err) {
        ctx.error(err);
      }
    });
  }

  const changed = () => {
    state.from = fromSelect.value;
    state.to = toSelect.value;
    setQuery({ from: state.from, to: state.to });
    drawDiff().catch(ctx.error);
  };
  fromSelect.addEventListener('change', changed);
  toSelect.addEventListener('change', changed);
  await load();
}

/** One <dialog> asking to confirm an activation; open(version, pipeline, onConfirm). */
function activateDialog() {
  const text = h('p');
  const confirm = h('button', { type: 'submit', value: 'activate', 'data-testid': 'activate-confirm' }, 'Activate');
  const cancel = h('button', { type: 'submit', value: 'cancel', class: 'secondary', 'data-testid': 'activate-cancel' },
    'Cancel');
  const element = h('dialog', { 'data-testid': 'activate-dialog', 'aria-labelledby': 'activate-title' },
    h('form', { method: 'dialog' },
      h('h2', { id: 'activate-title' }, 'Activate this version?'),
      text,
      h('div', { class: 'dialog-buttons' },
        cancel, confirm)));
  let action = null;
  element.addEventListener('close', () => {
    const run = element.returnValue === 'activate' ? action : null;
    action = null;
    if (run) run();
  });
  return {
    element,
    open(version, pipeline, onConfirm) {
      action = onConfirm;
      text.textContent = `Version ${version.version} becomes the active parameters of ${pipeline}: the jobs, ` +
        `evaluations and trainings of ${pipeline} started from now on use its values. You can activate another ` +
        'version at any time.';
      confirm.textContent = `Activate version ${version.version}`;
      element.returnValue = '';
      element.showModal();
      cancel.focus();
    },
  };
}
