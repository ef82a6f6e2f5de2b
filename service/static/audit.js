// The labelling view: shows the next queued pair (image by its tar offset, caption), sends a
// label on c / n / u (or a click), undoes on Backspace. Every request is same-origin JSON;
// the server picks the pair (blind repeats included), validates the label and counts.
(function () {
  "use strict";
  var root = document.getElementById("labeller");
  if (!root) { return; }
  var job = root.getAttribute("data-job");
  var base = "/ui/jobs/" + encodeURIComponent(job) + "/audit/";
  var img = document.getElementById("audit-image");
  var caption = document.getElementById("audit-caption");
  var figure = root.querySelector("figure.audit-pair");
  var progress = root.querySelector('[data-audit="progress"]');
  var summary = root.querySelector('[data-audit="summary"]');
  var error = root.querySelector('[data-audit="error"]');
  var done = root.querySelector("p.done");
  var current = null;
  var busy = false;

  function show(data) {
    progress.textContent = data.progress.labelled + " of " + data.progress.queue + " pairs labelled (" + data.progress.labels + " labels)";
    summary.textContent = data.summary + (data.warning ? " · " + data.warning : "");
    error.hidden = true;
    if (data.done) {
      current = null;
      figure.hidden = true;
      done.hidden = false;
      root.setAttribute("data-state", "done");
      return;
    }
    current = { position: data.position, key: data.key };
    figure.hidden = false;
    done.hidden = true;
    figure.setAttribute("data-key", data.key);
    img.src = "/ui/jobs/" + encodeURIComponent(job) + "/thumbs/" + encodeURIComponent(data.stem) + "/" + data.row;
    caption.textContent = data.caption === null ? "(caption not recorded)" : data.caption;
    root.setAttribute("data-position", String(data.position));
    root.setAttribute("data-state", "ready");
  }

  function fail(text) {
    error.textContent = text;
    error.hidden = false;
    root.setAttribute("data-state", "error");
  }

  function call(method, path, body) {
    busy = true;
    root.setAttribute("data-state", "busy");
    var init = { method: method, credentials: "same-origin", headers: { "Accept": "application/json" } };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    return fetch(base + path, init)
      .then(function (response) {
        if (response.status === 401) { window.location.assign("/ui/login"); return null; }
        return response.json().then(function (data) {
          if (!response.ok) { throw new Error(typeof data.detail === "string" ? data.detail : "request refused"); }
          return data;
        });
      })
      .then(function (data) { if (data) { show(data); } })
      .catch(function (e) { fail(String(e.message || e)); })
      .then(function () { busy = false; });
  }

  function label(value) {
    if (busy || current === null) { return; }
    call("POST", "labels.json", { position: current.position, key: current.key, label: value });
  }

  function undo() {
    if (busy) { return; }
    call("POST", "undo.json", {});
  }

  document.addEventListener("keydown", function (event) {
    if (event.ctrlKey || event.metaKey || event.altKey) { return; }
    var keys = { c: "clean", n: "noisy", u: "unsure" };
    if (keys[event.key]) { event.preventDefault(); label(keys[event.key]); }
    else if (event.key === "Backspace") { event.preventDefault(); undo(); }
  });
  root.addEventListener("click", function (event) {
    var target = event.target;
    if (target.getAttribute("data-label")) { label(target.getAttribute("data-label")); }
    else if (target.getAttribute("data-undo")) { undo(); }
  });
  call("GET", "next.json");
}());
