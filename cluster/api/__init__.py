"""The cluster's REST API resources under /api/v1/: serializers parse and show, `cluster.operations` changes
state. Nothing else writes.

    urls         ROUTES (the viewsets, for the router) and urlpatterns (the plain views), which
                 llmgw.api_urls mounts beside the gateway's (gateway.api)
    views        the viewsets and views;  serializers  what they parse and show
    base         what every resource of either app stands on;  errors  refusals as 400/404
    permissions  who may do what (DRF's authentication and permission classes);  schema  the OpenAPI extras

Kept empty of imports: DRF imports `permissions` while it starts, before it could import the views.
"""
