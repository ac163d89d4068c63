"""A minimal NBD client (fixed newstyle, OPT_GO, simple replies) used by the crash test, which
must know exactly which writes a FLUSH reply covered. Written from the NBD protocol document."""

import socket
import struct

NBDMAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
OPT_GO = 7
REP_ACK = 1
REP_INFO = 3
CMD_READ, CMD_WRITE, CMD_DISC, CMD_FLUSH, CMD_TRIM = 0, 1, 2, 3, 4
FLAG_FUA = 1


class NbdError(Exception):
    pass


class Client:
    def __init__(self, host, port, export, timeout=30):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.handle = 0
        magic, opt, flags = struct.unpack(">QQH", self._recv(18))
        if magic != NBDMAGIC or opt != IHAVEOPT:
            raise NbdError("not a fixed-newstyle NBD server")
        self.sock.sendall(struct.pack(">I", 1 | 2))  # FIXED_NEWSTYLE | NO_ZEROES
        name = export.encode()
        data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
        self.sock.sendall(struct.pack(">QII", IHAVEOPT, OPT_GO, len(data)) + data)
        self.size = None
        while True:
            rmagic, ropt, rtype, rlen = struct.unpack(">QIII", self._recv(20))
            payload = self._recv(rlen) if rlen else b""
            if rmagic != REPLY_MAGIC:
                raise NbdError("bad option reply magic")
            if rtype == REP_INFO and len(payload) >= 12 and struct.unpack(">H", payload[:2])[0] == 0:
                self.size, self.flags = struct.unpack(">QH", payload[2:12])
            elif rtype == REP_ACK:
                break
            elif rtype & 0x80000000:
                raise NbdError(f"OPT_GO refused: {rtype:#x} {payload!r}")
        if self.size is None:
            raise NbdError("server sent no export size")

    def _recv(self, n):
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise NbdError("connection closed")
            out += chunk
        return bytes(out)

    def _request(self, cmd, offset=0, length=0, data=b"", flags=0):
        self.handle += 1
        self.sock.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, flags, cmd, self.handle, offset, length) + data)
        magic, error, handle = struct.unpack(">IIQ", self._recv(16))
        if magic != SIMPLE_REPLY_MAGIC or handle != self.handle:
            raise NbdError("bad reply")
        payload = self._recv(length) if cmd == CMD_READ and error == 0 else b""
        if error:
            raise NbdError(f"command {cmd} failed with errno {error}")
        return payload

    def write(self, offset, data, fua=False):
        self._request(CMD_WRITE, offset, len(data), data, FLAG_FUA if fua else 0)

    def read(self, offset, length):
        return self._request(CMD_READ, offset, length)

    def flush(self):
        self._request(CMD_FLUSH)

    def trim(self, offset, length):
        self._request(CMD_TRIM, offset, length)

    def close(self):
        try:
            self.sock.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_DISC, 0, 0, 0))
        finally:
            self.sock.close()
