// lazy.js: the vendored libraries, loaded once and only by the pages that need them (a same-origin <script>,
// which the console's Content-Security-Policy allows): jsdiff (window.Diff) and uPlot (window.uPlot + its CSS).

const VENDOR = '/console/static/vendor';
const pending = new Map();

function script(src, global) {
  if (!pending.has(src)) {
    pending.set(src, new Promise((resolve, reject) => {
      if (window[global]) {
        resolve(window[global]);
        return;
      }
      const el = document.createElement('script');
      el.src = src;
      el.addEventListener('load', () => (window[global] ? resolve(window[global])
        : reject(new Error(`${src} did not define ${global}`))));
      el.addEventListener('error', () => {
        pending.delete(src);
        el.remove();
        reject(new Error(`${src} could not be loaded`));
      });
      document.head.append(el);
    }));
  }
  return pending.get(src);
}

function stylesheet(href) {
  if (!document.querySelector(`link[href="${href}"]`)) {
    const link = document.createElement('link');
    link.rel = 'stylesheet';
    link.href = href;
    document.head.append(link);
  }
}

/** jsdiff (https://github.com/kpdecker/jsdiff, BSD-3-Clause). */
export function loadDiff() {
  return script(`${VENDOR}/diff/diff.min.js`, 'Diff');
}

/** uPlot (https://github.com/leeoniya/uPlot, MIT). */
export function loadUPlot() {
  stylesheet(`${VENDOR}/uplot/uPlot.min.css`);
  return script(`${VENDOR}/uplot/uPlot.iife.min.js`, 'uPlot');
}
