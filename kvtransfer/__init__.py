"""tandem.kvtransfer"""
