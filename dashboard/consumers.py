"""The browser's websocket (`/ws/dashboard/`): which kinds of things changed, for a logged-in user's pages."""

from urllib.parse import urlsplit

from channels.auth import AuthMiddlewareStack
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from channels.security.websocket import WebsocketDenier

from dashboard.live import GROUP


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_active:
            await self.close(code=4401)  # the page's script sends the browser to the login page
            return
        await self.channel_layer.group_add(GROUP, self.channel_name)
        await self.accept()

    async def disconnect(self, code):
        await self.channel_layer.group_discard(GROUP, self.channel_name)

    async def receive_json(self, content, **kwargs):
        pass  # the browser only listens

    async def dashboard_changed(self, message):
        await self.send_json({"changed": message["families"]})


class SameOrigin:
    """Only pages this server served may open the socket: the Origin header must name the host the browser
    connected to (a page elsewhere cannot listen with the user's session cookie). Checked before the session
    is looked up."""

    def __init__(self, application):
        self.application = application

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers") or [])
        origin = headers.get(b"origin", b"").decode("latin-1")
        if origin and urlsplit(origin).netloc == headers.get(b"host", b"").decode("latin-1"):
            return await self.application(scope, receive, send)
        return await WebsocketDenier()(scope, receive, send)


def dashboard_socket():
    return SameOrigin(AuthMiddlewareStack(DashboardConsumer.as_asgi()))
