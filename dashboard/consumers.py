"""The browser's websocket (`/ws/dashboard/`): which kinds of things changed, for a logged-in user's pages.

Every Event (cluster.events.record) sends, after its transaction commits, one `dashboard.changed` per
transaction to the `dashboard` group (cluster.notify) with the Event kinds' families (`replica`, `node`,
`model`, `system`, ...); transactions a process commits while its last message is still under way share the
next one. This consumer passes them on; the page's partials that show a family fetch themselves
again (htmx). The pages also refresh on a slow timer, so a lost message costs nothing.
"""

from channels.auth import AuthMiddlewareStack
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from cluster.clients import same_origin
from cluster.notify import DASHBOARD_GROUP, EndsWhenTheLayerIsAway, StopsCleanly


class DashboardConsumer(EndsWhenTheLayerIsAway, StopsCleanly, AsyncJsonWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_active:
            await self.close(code=4401)  # the page's script sends the browser to the login page
            return
        await self.channel_layer.group_add(DASHBOARD_GROUP, self.channel_name)
        await self.accept()

    async def disconnect(self, code):
        await self.channel_layer.group_discard(DASHBOARD_GROUP, self.channel_name)

    async def receive_json(self, content, **kwargs):
        pass  # the browser only listens

    async def dashboard_changed(self, message):
        await self.send_json({"changed": message["families"]})


class SameOrigin:
    """Only pages this server served may open the socket: the Origin header must name the scheme, host and port
    the browser connected with, and the host must be an allowed one (a page elsewhere cannot listen with the
    user's session cookie; an http page not to a wss socket). Checked before the session is looked up."""

    def __init__(self, application):
        self.application = application

    async def __call__(self, scope, receive, send):
        if same_origin(scope):
            return await self.application(scope, receive, send)
        return await turned_away(scope, receive, send)


async def turned_away(scope, receive, send):
    """The socket refused at its handshake (HTTP 403). Not Channels' WebsocketDenier: that is a consumer, which
    waits on the channel layer from its start, and redis-py can swallow the cancellation of that wait (see
    `cluster.notify.StopsCleanly`), leaving it waiting after the socket is gone."""
    if (await receive())["type"] == "websocket.connect":
        await send({"type": "websocket.close"})


def dashboard_socket():
    return SameOrigin(AuthMiddlewareStack(DashboardConsumer.as_asgi()))
