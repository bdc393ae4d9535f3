// pages/candidates.js: the candidates a selection-gated training scored (its history): each one's parent, what it
// changed, its minibatch score against its parent's, the gain against the noise that had to be beaten, accepted or
// not, and its validation score; the best is marked. Shown on a training's page.

import { h, table, td, truncated } from '../dom.js';
import * as fmt from '../format.js';

const COLUMNS = ['Candidate', 'Step', 'Kind', 'Parent', 'Changed', { label: 'Minibatch', class: 'num' },
  { label: 'Gain', class: 'num' }, { label: 'Noise', class: 'num' }, 'Accepted', { label: 'Validation', class: 'num' }];

/** The candidates table, or null when the training kept no candidates (SFA runs). */
export function candidatesTable(candidates) {
  if (!candidates || !candidates.length) return null;
  const rows = candidates.map((c) => {
    const [gainText, gainClass] = fmt.delta(c.gain);
    const accepted = c.accepted === true;
    return h('tr', { 'data-testid': 'candidate-row', 'data-accepted': String(accepted),
      'data-best': String(c.best === true), class: c.best ? 'selected' : null },
    td(h('span', { class: 'mono' }, String(c.id ?? '—'), c.best ? h('strong', {}, ' ★ best') : null)),
    td(String(c.step ?? '—'), 'num'),
    td(c.kind || '—'),
    td(c.parent === null || c.parent === undefined ? '—' : h('span', { class: 'mono' }, String(c.parent))),
    td(changedText(c), 'text'),
    td(`${fmt.score(c.parent_minibatch_score)} → ${fmt.score(c.minibatch_score)}`, 'num nowrap'),
    td(h('span', { class: gainClass }, gainText.replace(/ (improved|regressed|unchanged)$/, '')), 'num nowrap'),
    td(c.noise === null || c.noise === undefined ? '—' : c.noise.toFixed(3), 'num'),
    td(accepted ? '✓ accepted' : (c.kind === 'seed' ? '— start' : '✗ rejected'), 'nowrap'),
    td(fmt.score(c.val_score), 'num'));
  });
  return table('candidates-table', COLUMNS, rows, 'Candidates scored by the training');
}

function changedText(c) {
  const names = c.changed || [];
  if (!names.length) return c.note ? truncated(c.note, 120) : '—';
  const parts = names.map((name) => {
    const value = c.state ? c.state[name] : undefined;
    if (Array.isArray(value)) return `${name}: ${value.length} demonstration${value.length === 1 ? '' : 's'}`;
    return `${name}: ${fmt.valueText(value)}`;
  });
  return truncated(parts.join('; '), 200);
}
