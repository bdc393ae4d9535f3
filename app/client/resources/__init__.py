"""The client's resources, one module per part of the API: each has an asynchronous class (the calls) and a
synchronous one that names the same methods (``app.client._sync``)."""
