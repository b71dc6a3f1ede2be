// Loads one dump at a time by adding a <script> tag (a file:// page cannot fetch()):
// data/rN/<kind>_NNNNNN.js calls window.__skyrlDump(key, document) or
// (key, null, message). A few recent steps stay in memory for paging back and forth.
"use strict";
(function () {
  const pending = new Map();
  const cache = new Map();
  const CACHE_SIZE = 12;

  window.__skyrlDump = function (key, doc, message) {
    const waiter = pending.get(key);
    if (!waiter) return;
    pending.delete(key);
    if (doc) waiter.resolve(doc);
    else waiter.reject(new Error(message || `${waiter.url}: no document`));
  };

  function remember(key, result) {
    cache.set(key, result);
    if (cache.size > CACHE_SIZE) cache.delete(cache.keys().next().value);
  }

  // Resolves to the page document, or rejects with an Error whose message names the file.
  function loadDump(runId, kind, step, url) {
    const key = `${runId}/${kind}/${step}`;
    if (cache.has(key)) return cache.get(key);
    const promise = new Promise((resolve, reject) => {
      pending.set(key, { resolve, reject, url });
      const tag = document.createElement("script");
      tag.src = url;
      tag.onerror = () => {
        tag.remove();
        if (pending.delete(key)) {
          reject(new Error(`${url}: could not be loaded (missing: write the page again with ` +
            `python -m skyrl_train.entrypoints.view)`));
        }
      };
      tag.onload = () => {
        tag.remove();
        if (pending.delete(key)) reject(new Error(`${url}: loaded but held no dump`));
      };
      document.head.appendChild(tag);
    });
    // Keep failures too (a torn file stays torn), but not a file that was missing.
    promise.catch((err) => { if (/could not be loaded/.test(err.message)) cache.delete(key); });
    remember(key, promise);
    return promise;
  }

  window.skyrlLoader = { loadDump };
})();
