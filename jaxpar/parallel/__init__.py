"""The mesh, logical axes -> shardings, ZeRO's reductions, context parallelism's order, the pipeline engines: every collective jaxpar writes by hand lives here; no model."""
