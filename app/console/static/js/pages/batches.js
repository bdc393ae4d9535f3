// pages/batches.js: /console/batches: the OpenAI Batch API's batches, newest first: status, request counts, and
// downloads of their input, output and error files. Polls while a batch on the page is in progress.

import { badge, h, progress, td } from '../dom.js';
import * as fmt from '../format.js';
import { downloadButton } from '../files_common.js';
import { cursorList } from '../listing.js';

const COLUMNS = ['Batch', 'Status', 'Endpoint', 'Requests', 'Input', 'Output', 'Errors', 'Created'];
const BATCH_LIVE = new Set(['validating', 'in_progress', 'finalizing', 'cancelling']);

export function render(ctx) {
  return cursorList(ctx, {
    title: 'Batches',
    path: '/v1/batches',
    testid: 'batches-table',
    columns: COLUMNS,
    empty: 'No batches yet. Upload a JSONL file with POST /v1/files, then POST /v1/batches.',
    live: (b) => BATCH_LIVE.has(b.status),
    row: (b) => {
      const counts = b.request_counts || {};
      const done = (counts.completed || 0) + (counts.failed || 0);
      return h('tr', { 'data-testid': 'batch-row', 'data-batch-id': b.id, 'data-status': b.status },
        td(b.id, 'id'),
        td(badge(b.status), 'nowrap'),
        td(h('code', {}, b.endpoint || '—')),
        td(h('span', {}, progress(done, counts.total, 'batch-progress'),
          h('span', { class: 'muted' }, ` ${fmt.number(counts.completed)} ok, ${fmt.number(counts.failed)} failed`)), 'nowrap'),
        td(downloadButton(b.input_file_id, 'Input', ctx, 'download-input'), 'nowrap'),
        td(downloadButton(b.output_file_id, 'Output', ctx, 'download-output'), 'nowrap'),
        td(downloadButton(b.error_file_id, 'Errors', ctx, 'download-errors'), 'nowrap'),
        td(fmt.time(b.created_at), 'nowrap'));
    },
  });
}
