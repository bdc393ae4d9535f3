// pages/pipelines.js: /console/pipelines: the pipelines this key may run, with the active parameter version and
// how many versions each has.

import { h, td, to } from '../dom.js';
import { cursorList } from '../listing.js';

const COLUMNS = ['Pipeline', { label: 'Active version', class: 'num' }, { label: 'Versions', class: 'num' }];

export function render(ctx) {
  return cursorList(ctx, {
    title: 'Pipelines',
    path: '/v1/pipelines',
    paged: false,
    testid: 'pipelines-table',
    columns: COLUMNS,
    empty: 'No pipelines are registered on this server.',
    row: (p) => h('tr', { 'data-testid': 'pipeline-row', 'data-pipeline': p.name },
      td(to('pipelines', p.name)),
      td(p.active_version ?? '—', 'num'),
      td(Array.isArray(p.versions) ? p.versions.length : p.versions ?? '—', 'num')),
  });
}
