// Live progress: polls the page's JSON endpoint (data-progress-url) and swaps in the texts
// of the cells marked data-field inside each element marked data-job. No library, no
// build step; the server formats every value. Stops once no job on the page is active.
(function () {
  "use strict";
  var body = document.body;
  var url = body.getAttribute("data-progress-url");
  if (!url) { return; }
  var every = Math.max(250, Number(body.getAttribute("data-poll-ms")) || 2000);
  var reloadOnEnd = body.getAttribute("data-reload-on-end") === "1";
  var TERMINAL = ["SUCCEEDED", "PARTIAL", "FAILED", "CANCELLED"];

  function apply(job) {
    var rows = document.querySelectorAll("tr[data-job]");
    var wasActive = false;
    var found = false;
    for (var i = 0; i < rows.length; i++) {
      var row = rows[i];
      if (row.getAttribute("data-job") !== job.id) { continue; }
      found = true;
      if (TERMINAL.indexOf(row.getAttribute("data-state")) < 0) { wasActive = true; }
      Object.keys(job.fields).forEach(function (name) {
        var cell = row.querySelector('[data-field="' + name + '"]');
        if (cell && cell.textContent !== job.fields[name]) { cell.textContent = job.fields[name]; }
      });
      var badge = row.querySelector('[data-field="state"]');
      if (badge) { badge.className = "state state-" + job.state.toLowerCase(); }
      row.setAttribute("data-state", job.state);
    }
    return found && wasActive && TERMINAL.indexOf(job.state) >= 0;
  }

  function tick() {
    fetch(url, { credentials: "same-origin", headers: { "Accept": "application/json" } })
      .then(function (response) {
        if (response.status === 401) { window.location.assign("/ui/login"); return null; }
        return response.ok ? response.json() : null;
      })
      .then(function (data) {
        if (data === null) { schedule(); return; }
        var active = false;
        var ended = false;
        data.items.forEach(function (job) {
          if (apply(job)) { ended = true; }
          if (TERMINAL.indexOf(job.state) < 0) { active = true; }
        });
        // A job page shows charts of committed shards: reload once when its job ends.
        if (ended && reloadOnEnd) { window.location.reload(); return; }
        if (active) { schedule(); }
      })
      .catch(function () { schedule(); });
  }

  function schedule() { window.setTimeout(tick, every); }
  schedule();
}());
