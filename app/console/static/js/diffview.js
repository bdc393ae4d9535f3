// diffview.js: a word diff of two texts with jsdiff, written as text in <del> (only in the first) and <ins> (only
// in the second) elements; a legend says which side is which.

import { h } from './dom.js';
import { prettyValue } from './format.js';
import { loadDiff } from './lazy.js';

const WORD_LIMIT = 20000; // longer texts are compared line by line (a word diff of them would be slow)

/** A <div class="diff"> of `before` → `after` (any values: non-strings as pretty JSON). */
export async function wordDiff(before, after, attrs = {}) {
  const Diff = await loadDiff();
  const a = prettyValue(before);
  const b = prettyValue(after);
  const parts = a.length + b.length > WORD_LIMIT * 2 ? Diff.diffLines(a, b) : Diff.diffWords(a, b);
  const box = h('div', { class: 'diff', ...attrs });
  for (const part of parts) {
    if (part.added) box.append(h('ins', {}, part.value));
    else if (part.removed) box.append(h('del', {}, part.value));
    else box.append(part.value);
  }
  if (a === b) box.append(h('span', { class: 'muted' }, a ? ' (identical)' : '(empty on both sides)'));
  return box;
}

/** "del: only in X · ins: only in Y" */
export function legend(left, right) {
  return h('p', { class: 'legend' }, h('del', {}, 'struck out'), ` only in ${left}; `,
    h('ins', {}, 'underlined'), ` only in ${right}.`);
}
