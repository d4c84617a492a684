"""tandem.decode_worker"""
