"""tandem.engine.runtime: Running an engine: the engine (schedule -> execute -> update), the model runner,
the engine loop a worker drives, the messages that cross a worker boundary.
"""
