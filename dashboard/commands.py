"""Every command an operator has, by its three front doors: the CLI command, the dashboard button (a URL name in
dashboard/urls.py) and the REST API endpoint. docs/dashboard.md's table says the same; tests/dashboard/test_views.py
fails when a command of the CLI's tree (llmgw/cli/tree.py) is neither here nor in LOCAL, or a button or endpoint
does not resolve, or the table lacks it."""

from __future__ import annotations

# CLI command -> (dashboard URL name, "METHOD /api/v1/... endpoint")
COMMANDS: dict[str, tuple[str, str]] = {
    "status": ("overview", "GET /api/v1/system/status/"),
    "stop": ("system-stop", "POST /api/v1/system/stop/"),
    "start": ("system-start", "POST /api/v1/system/start/"),
    "restart": ("system-restart", "POST /api/v1/system/restart/"),
    "node add": ("node-add", "POST /api/v1/nodes/"),
    "node remove": ("node-remove", "DELETE /api/v1/nodes/{name}/"),
    "node token": ("node-token", "POST /api/v1/nodes/{name}/token/"),
    "node list": ("nodes", "GET /api/v1/nodes/"),
    "user add": ("user-add", "POST /api/v1/users/"),
    "user list": ("users", "GET /api/v1/users/"),
    "mirror import": ("mirror-import", "POST /api/v1/model-files/"),  # and Mirror: Upload (multipart "file")
    "mirror list": ("mirror", "GET /api/v1/model-files/"),
    "mirror ls": ("mirror", "GET /api/v1/model-files/"),  # and GET /api/v1/control-planes/: where each file is
    "control-plane list": ("mirror", "GET /api/v1/control-planes/"),
    "control-plane remove": ("control-plane-remove", "DELETE /api/v1/control-planes/{name}/"),
    "control-plane token": ("control-plane-token", "POST /api/v1/control-planes/{name}/token/"),
    "ctl nodes": ("nodes", "GET /api/v1/nodes/"),
    "ctl drain": ("node-drain", "POST /api/v1/nodes/{name}/drain/"),
    "ctl undrain": ("node-undrain", "POST /api/v1/nodes/{name}/undrain/"),
    "ctl models": ("models", "GET /api/v1/models/"),
    "ctl model add": ("model-add", "POST /api/v1/models/"),
    "ctl model set": ("model-set", "PATCH /api/v1/models/{name}/"),
    "ctl model remove": ("model-remove", "DELETE /api/v1/models/{name}/"),
    "ctl rollout start": ("rollout-start", "POST /api/v1/models/{name}/rollout/"),
    "ctl rollout status": ("rollout", "GET /api/v1/models/{name}/rollout/"),
    "ctl rollout promote": ("rollout-promote", "POST /api/v1/models/{name}/rollout/promote/"),
    "ctl rollout abort": ("rollout-abort", "POST /api/v1/models/{name}/rollout/abort/"),
    "ctl replicas": ("replicas", "GET /api/v1/replicas/"),
    "ctl restart": ("replicas-restart", "POST /api/v1/restart"),
    "ctl profiles": ("profiles", "GET /api/v1/profiles/"),
    "ctl profile add": ("profile-add", "POST /api/v1/profiles/"),
    "ctl profile set": ("profile-set", "PATCH /api/v1/profiles/{name}/"),
    "ctl profile remove": ("profile-remove", "DELETE /api/v1/profiles/{name}/"),
    "ctl engines": ("engines", "GET /api/v1/engines/"),
    "ctl engine add": ("engine-add", "POST /api/v1/engines/"),
    "ctl engine set": ("engine-set", "PATCH /api/v1/engines/{name}/"),
    "ctl engine-key show": ("engine-key-show", "GET /api/v1/engine-key/"),
    "ctl engine-key rotate": ("engine-key-rotate", "POST /api/v1/engine-key/rotate/"),
    "ctl settings": ("settings-set", "PATCH /api/v1/settings/"),
    "ctl keys list": ("keys", "GET /api/v1/keys/"),
    "ctl keys create": ("key-create", "POST /api/v1/keys/"),
    "ctl keys set": ("key-set", "PATCH /api/v1/keys/{name}/"),
    "ctl keys revoke": ("key-revoke", "POST /api/v1/keys/{name}/revoke/"),
    "ctl usage": ("usage", "GET /api/v1/usage/"),  # and Usage: Download CSV (`usage-csv`), as `?format=csv`
    "ctl requests": ("requests", "GET /api/v1/requests/"),
    "ctl events": ("events", "GET /api/v1/events/"),
}

# The commands that run on this machine by their nature, so have no button or endpoint (llmgw.cli.tree.LOCAL),
# each with why. Keyed by the command's first word: every subcommand of it is one too.
LOCAL: dict[str, str] = {
    "up": "runs the whole system on this machine: until it runs there is no server to ask",
    "agent": "runs this machine's agent (or stops the engines it recorded), which dials the server",
    "service": "installs, starts and stops this machine's systemd units",
    "login": "stores a server and token for the CLI on this machine; the dashboard has its own login page",
    "logout": "forgets the CLI's stored login on this machine; the dashboard has Log out",
    "completion": "prints the CLI's shell completion script",
}
