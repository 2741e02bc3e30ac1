"""The request contract, declared once.

A request is a pydantic model here; everything else is derived from it: the HTTP parser
(the query string validated against the model), the OpenAPI parameters, the MCP tools' input
schemas, and the request document memory._plan reads (whose SQL names each field carries;
tests/test_contract.py holds the database's signatures to them). Bounds are poimen_core's
vocabulary, which the SQL checks read too, so an out-of-range value is the same typed error,
naming the parameter, over HTTP, MCP and SQL.
"""

from poimen_memory.contract.query import QueryRequest, parse_query

__all__ = ["QueryRequest", "parse_query"]
