"""What every part of the core uses: its errors (one class per gRPC status), its runtime switches (`settings`), the
services' default ports and names, and the threads models compute on."""
