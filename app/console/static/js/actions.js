// actions.js: what the jobs pages share: cancelling a job after the user confirms it.

import { api } from './api.js';

/** Ask to confirm, then POST /v1/jobs/{id}/cancel. True when the job was asked to cancel. */
export async function cancelJob(id, ctx) {
  if (!window.confirm(`Cancel job ${id}? Its items that have not finished will not run.`)) return false;
  try {
    await api(`/v1/jobs/${encodeURIComponent(id)}/cancel`, { method: 'POST' });
    return true;
  } catch (err) {
    ctx.error(err);
    return false;
  }
}
