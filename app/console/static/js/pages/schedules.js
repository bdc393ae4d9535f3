// pages/schedules.js: /console/schedules: the scheduled evaluations (cron, regression margin, next and last fire).

import { h, td, to } from '../dom.js';
import * as fmt from '../format.js';
import { cursorList } from '../listing.js';

const COLUMNS = ['Schedule', 'Pipeline', 'Cron', { label: 'Margin', class: 'num' }, 'State', 'Next fire', 'Last fire',
  'Created'];

export function render(ctx) {
  return cursorList(ctx, {
    title: 'Schedules',
    path: '/v1/evaluations/schedules',
    paged: false,
    testid: 'schedules-table',
    columns: COLUMNS,
    empty: 'No schedules yet. Create one with POST /v1/evaluations/schedules.',
    row: (s) => h('tr', { 'data-testid': 'schedule-row', 'data-schedule-id': s.id },
      td(to('schedules', s.id), 'id'),
      td(to('pipelines', s.pipeline)),
      td(h('code', {}, s.cron), 'nowrap'),
      td(fmt.score(s.margin), 'num'),
      td(s.enabled ? 'enabled' : 'paused'),
      td(fmt.time(s.next_fire_at), 'nowrap'),
      td(fmt.time(s.last_fire_at), 'nowrap'),
      td(fmt.time(s.created_at), 'nowrap')),
  });
}
