// pages/files.js: /console/files: the uploaded and generated files, newest first, each with a download button.

import { h, td } from '../dom.js';
import * as fmt from '../format.js';
import { downloadButton } from '../files_common.js';
import { cursorList } from '../listing.js';

const COLUMNS = ['File', 'Name', 'Purpose', { label: 'Size', class: 'num' }, 'Created', 'Download'];

export function render(ctx) {
  return cursorList(ctx, {
    title: 'Files',
    path: '/v1/files',
    query: { order: 'desc' },
    testid: 'files-table',
    columns: COLUMNS,
    empty: 'No files yet. Upload one with POST /v1/files.',
    row: (f) => h('tr', { 'data-testid': 'file-row', 'data-file-id': f.id },
      td(f.id, 'id'),
      td(f.filename, 'text'),
      td(f.purpose),
      td(fmt.bytes(f.bytes), 'num'),
      td(fmt.time(f.created_at), 'nowrap'),
      td(downloadButton(f.id, 'Download', ctx), 'nowrap')),
  });
}
