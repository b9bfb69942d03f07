"""`llmgw user add|list`: users with a role, an API token and (for the dashboard) a password."""

from __future__ import annotations

from llmgw.cli.output import age, as_json, now, table


def user_add(o, out):
    body = {"name": o["name"], "role": o["role"], **({"password": o["password"]} if o["password"] else {})}
    user = o["api"].post("users/", body, doing="add users")
    out.write(f"user {user['name']} added as {user['role']}; API token (shown once): {user['token']}\n")
    if not o["password"]:
        out.write("no password set: give --password to let this user log in to the dashboard\n")


def users_list(o, out):
    users = o["api"].rows("users/")
    if o.get("json"):
        return as_json(users, out)
    at = now()
    table(["NAME", "ROLE", "PASSWORD", "ACTIVE", "LAST LOGIN"],
          [[u["name"], u["role"] or "none", "yes" if u["password"] else "no (API token only)",
            "yes" if u["active"] else "no",
            age(u["last_login_at"], at) + (" ago" if u["last_login_at"] else "")] for u in users], out)
