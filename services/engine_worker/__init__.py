"""services/engine_worker"""
