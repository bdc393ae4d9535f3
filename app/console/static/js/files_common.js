// files_common.js: a button that downloads a stored file (GET /v1/files/{id}/content with the key, saved as a Blob).

import { download } from './api.js';
import { h } from './dom.js';

export function downloadButton(fileId, label, ctx, testid = 'download-file') {
  if (!fileId) return h('span', { class: 'muted' }, '—');
  const button = h('button', { type: 'button', class: 'secondary', 'data-testid': testid, 'data-file-id': fileId,
    'data-key': `${testid}-${fileId}`, title: `Download file ${fileId}` }, label);
  button.addEventListener('click', async () => {
    button.disabled = true;
    try {
      await download(`/v1/files/${encodeURIComponent(fileId)}/content`, {}, `${fileId}.jsonl`);
    } catch (err) {
      ctx.error(err);
    } finally {
      button.disabled = false;
    }
  });
  return button;
}
