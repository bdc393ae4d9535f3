// pages/evaluations.js: /console/evaluations: the evaluations, newest first (pipeline, parameter version,
// dataset, status, mean score, number of examples), 50 a page.

import { badge, h, link, td, to } from '../dom.js';
import * as fmt from '../format.js';
import { cursorList } from '../listing.js';

const COLUMNS = ['Evaluation', 'Pipeline', { label: 'Version', class: 'num' }, 'Dataset', 'Status',
  { label: 'Score (mean)', class: 'num' }, { label: 'Examples', class: 'num' }, 'Schedule', 'Created'];

export function datasetText(dataset) {
  if (!dataset) return '—';
  if (typeof dataset !== 'object') return fmt.valueText(dataset);
  const where = dataset.name || (dataset.file_id ? `file ${dataset.file_id}` : dataset.source || 'inline');
  return dataset.examples !== undefined && dataset.examples !== null ? `${where} · ${fmt.number(dataset.examples)} examples` : where;
}

export function render(ctx) {
  return cursorList(ctx, {
    title: 'Evaluations',
    path: '/v1/evaluations',
    testid: 'evaluations-table',
    columns: COLUMNS,
    empty: 'No evaluations yet. Start one with POST /v1/evaluations.',
    live: (e) => fmt.isLive(e.status),
    row: (e) => h('tr', { 'data-testid': 'evaluation-row', 'data-evaluation-id': e.id, 'data-status': e.status },
      td(to('evaluations', e.id), 'id'),
      td(to('pipelines', e.pipeline)),
      td(e.parameter_version ?? '—', 'num'),
      td(datasetText(e.dataset)),
      td(badge(e.status), 'nowrap'),
      td(fmt.score(e.score), 'num'),
      td(fmt.number(e.progress ? e.progress.total_examples : null), 'num'),
      td(e.schedule_id ? link(`/console/schedules/${encodeURIComponent(e.schedule_id)}`, e.schedule_id) : '—', 'id'),
      td(fmt.time(e.created_at), 'nowrap')),
  });
}
