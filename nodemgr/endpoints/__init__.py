"""The two endpoints' request handlers, one per message type: the task endpoint (each
environment's socket) and the admin endpoint. They turn a typed request into calls on the
node and a typed reply; they hold no state of their own.
"""
