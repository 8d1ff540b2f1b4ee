"""The MCP stage gate: tool calls of the Model Context Protocol recorded, replayed, and held back
until a booth's verdict (docs/mcp.md).

One concept per module:

- `policy`: which decision (allow, stage, deny, ask) a tool call gets.
- `record`: the frames a call becomes, and the sinks they go to (a tape of the gateway's own, or a
  booth's supervisor through its control socket).
- `gateway`: the stdio gateway `jukebox mcp wrap`, an MCP server facing the agent and an MCP
  client facing the real server, both the official SDK's.
"""
