// pages/trainings.js: /console/trainings: the trainings, newest first (pipeline, status, steps done, versions).

import { badge, h, progress, td, to } from '../dom.js';
import * as fmt from '../format.js';
import { cursorList } from '../listing.js';

const COLUMNS = ['Training', 'Pipeline', 'Status', 'Steps', 'Versions', 'Optimizer', { label: 'Duration', class: 'num' },
  'Created'];

export function render(ctx) {
  return cursorList(ctx, {
    title: 'Trainings',
    path: '/v1/trainings',
    testid: 'trainings-table',
    columns: COLUMNS,
    empty: 'No trainings yet. Start one with POST /v1/trainings.',
    live: (t) => fmt.isLive(t.status),
    row: (t) => {
      const p = t.progress || {};
      return h('tr', { 'data-testid': 'training-row', 'data-training-id': t.id, 'data-status': t.status },
        td(to('trainings', t.id), 'id'),
        td(to('pipelines', t.pipeline)),
        td(badge(t.status), 'nowrap'),
        td(progress(p.completed_steps, p.total_steps, 'training-progress'), 'nowrap'),
        td(versions(t), 'nowrap'),
        td(t.optimizer && t.optimizer.type ? t.optimizer.type : '—'),
        td(fmt.duration(t.started_at, t.finished_at), 'num'),
        td(fmt.time(t.created_at), 'nowrap'));
    },
  });
}

export function versions(t) {
  if (t.base_version === null || t.base_version === undefined) return '—';
  return t.final_version !== null && t.final_version !== undefined && t.final_version !== t.base_version
    ? `v${t.base_version} → v${t.final_version}` : `v${t.base_version}`;
}
