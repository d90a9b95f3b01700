"""The gRPC front door (`GenerationService`): validation, prompt encoding, and a generation's events turned into
responses and text.
"""
