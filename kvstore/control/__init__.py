"""The control-plane contract: what nodes, clients and kvctl need to talk to a master.

:mod:`kvstore.control.client` (:class:`~kvstore.control.client.MasterClient`, one or several
masters), :mod:`kvstore.control.wire` (the protobuf translation, with every bound) and
:mod:`kvstore.control.records` (the record types). Importing them loads none of the
master's own modules (server, service, index, membership, watches): those live in
:mod:`kvstore.master` and import this package, never the other way round.
"""
