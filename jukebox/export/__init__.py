"""Sending tapes elsewhere: OpenTelemetry (docs/otel.md).

`otel_ids` derives trace and span ids from a tape id, `otel_llm` reads what a model call's
recorded bodies say (finish reasons, response model and id), `otel_content` turns messages into
the GenAI conventions' JSON (only on request, scrubbed), `otel_mapping` turns frames into span
plans (pure data, no SDK), and `otel_send` hands them to the OpenTelemetry SDK: a whole tape at
once (`jukebox export otel`) or frame by frame during a booth run (`otel_live`).
"""
