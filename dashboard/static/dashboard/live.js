// Live pages: the server says over a websocket which kinds of things changed ({"changed": ["replica", ...]});
// every partial on the page that shows that kind refetches itself (hx-trigger="llmgw:replica from:body").
// "llmgw:any" fires on every change. Reconnects with back-off; a closed session sends the browser to log in.
(function () {
  "use strict";
  var delay = 500;
  function state(text, cls) {
    var el = document.getElementById("live-state");
    if (el) { el.textContent = text; el.className = "live-state " + (cls || ""); }
  }
  function connect() {
    var scheme = location.protocol === "https:" ? "wss://" : "ws://";
    var ws = new WebSocket(scheme + location.host + (document.body.dataset.live || "/ws/dashboard/"));
    ws.onopen = function () { delay = 500; state("live", "on"); };
    ws.onmessage = function (msg) {
      var data;
      try { data = JSON.parse(msg.data); } catch (e) { return; }
      (data.changed || []).forEach(function (family) { htmx.trigger(document.body, "llmgw:" + family); });
      htmx.trigger(document.body, "llmgw:any");
    };
    ws.onclose = function (ev) {
      if (ev.code === 4401) {
        location.href = (document.body.dataset.login || "/login/") + "?next=" + encodeURIComponent(location.pathname);
        return;
      }
      state("reconnecting…", "off");
      setTimeout(connect, delay);
      delay = Math.min(delay * 2, 10000);
    };
  }
  // A refused button (403) or a server error: say so on the page instead of doing nothing.
  document.addEventListener("htmx:responseError", function (ev) {
    var box = document.getElementById("messages");
    if (!box) return;
    var div = document.createElement("div");
    div.className = "msg error";
    div.setAttribute("role", "status");
    var xhr = ev.detail.xhr;
    div.textContent = xhr.status === 403 ? (xhr.responseText || "refused") : "the server answered " + xhr.status;
    box.replaceChildren(div);
  });
  document.addEventListener("DOMContentLoaded", connect);
})();
