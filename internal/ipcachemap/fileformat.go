package ipcachemap

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
)

// The map file is a 32-byte header followed by count records of KeySize +
// ValueSize bytes, each laid out exactly as in the BPF map (so records are in
// host byte order, like the kernel's copy).
//
//	offset size  field
//	0      8     magic "idipcmap"
//	8      4     format version (1)
//	12     2     key size (24)
//	14     2     value size (12)
//	16     1     record byte order: 1 little endian, 2 big endian
//	17     3     zero
//	20     8     record count
//	28     4     CRC32C (Castagnoli) of header bytes 0..28 and all records
//
// Header integers are little endian whatever the host, so that a file
// carried to a host of the other byte order is reported as such rather than
// as garbage.
const (
	fileMagic   = "idipcmap"
	fileVersion = 1
	headerSize  = 32
	recordSize  = KeySize + ValueSize
)

const (
	orderLittle = 1
	orderBig    = 2
)

// ErrCorrupt is wrapped by errors about map files that fail validation.
var ErrCorrupt = errors.New("corrupt ipcache map file")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func nativeOrder() byte {
	if binary.NativeEndian.Uint16([]byte{1, 0}) == 1 {
		return orderLittle
	}
	return orderBig
}

// encodeFile writes the header and records of entries into buf (reused when
// large enough) and returns the file contents.
func encodeFile(buf []byte, entries map[rawKey]rawValue) []byte {
	size := headerSize + len(entries)*recordSize
	if cap(buf) < size {
		buf = make([]byte, size)
	}
	buf = buf[:size]
	copy(buf[0:8], fileMagic)
	binary.LittleEndian.PutUint32(buf[8:12], fileVersion)
	binary.LittleEndian.PutUint16(buf[12:14], KeySize)
	binary.LittleEndian.PutUint16(buf[14:16], ValueSize)
	buf[16] = nativeOrder()
	buf[17], buf[18], buf[19] = 0, 0, 0
	binary.LittleEndian.PutUint64(buf[20:28], uint64(len(entries)))
	off := headerSize
	for k, v := range entries {
		copy(buf[off:], k[:])
		copy(buf[off+KeySize:], v[:])
		off += recordSize
	}
	crc := crc32.Update(crc32.Checksum(buf[0:28], castagnoli), castagnoli, buf[headerSize:])
	binary.LittleEndian.PutUint32(buf[28:32], crc)
	return buf
}

// decodeFile validates a map file and returns its records. Every failure
// wraps ErrCorrupt.
func decodeFile(data []byte) (map[rawKey]rawValue, error) {
	if len(data) < headerSize {
		return nil, fmt.Errorf("%w: %d bytes, shorter than the %d-byte header", ErrCorrupt, len(data), headerSize)
	}
	if string(data[0:8]) != fileMagic {
		return nil, fmt.Errorf("%w: bad magic %q", ErrCorrupt, data[0:8])
	}
	if v := binary.LittleEndian.Uint32(data[8:12]); v != fileVersion {
		return nil, fmt.Errorf("%w: unsupported format version %d (want %d)", ErrCorrupt, v, fileVersion)
	}
	ks, vs := binary.LittleEndian.Uint16(data[12:14]), binary.LittleEndian.Uint16(data[14:16])
	if ks != KeySize || vs != ValueSize {
		return nil, fmt.Errorf("%w: key/value sizes %d/%d, want %d/%d", ErrCorrupt, ks, vs, KeySize, ValueSize)
	}
	if data[16] != nativeOrder() {
		return nil, fmt.Errorf("%w: records in byte order %d, this host uses %d", ErrCorrupt, data[16], nativeOrder())
	}
	count := binary.LittleEndian.Uint64(data[20:28])
	body := data[headerSize:]
	if count > uint64(len(body))/recordSize || uint64(len(body)) != count*recordSize {
		return nil, fmt.Errorf("%w: header says %d records, file holds %d bytes of records", ErrCorrupt, count, len(body))
	}
	want := binary.LittleEndian.Uint32(data[28:32])
	if got := crc32.Update(crc32.Checksum(data[0:28], castagnoli), castagnoli, body); got != want {
		return nil, fmt.Errorf("%w: checksum %#08x, header says %#08x", ErrCorrupt, got, want)
	}
	entries := make(map[rawKey]rawValue, count)
	var k Key
	for off := 0; off < len(body); off += recordSize {
		rk := rawKey(body[off : off+KeySize])
		if err := k.get(&rk); err != nil {
			return nil, fmt.Errorf("%w: record %d: %w", ErrCorrupt, off/recordSize, err)
		}
		// Only the canonical (masked) form is ever written; anything else
		// would be a second key for the same prefix.
		var canon rawKey
		_ = k.put(&canon)
		if canon != rk {
			return nil, fmt.Errorf("%w: record %d: key %s is not in canonical form", ErrCorrupt, off/recordSize, k)
		}
		if _, dup := entries[rk]; dup {
			return nil, fmt.Errorf("%w: record %d: duplicate key %s", ErrCorrupt, off/recordSize, k)
		}
		entries[rk] = rawValue(body[off+KeySize : off+recordSize])
	}
	return entries, nil
}

// ReadFile decodes the map file at path, for tools that inspect the state
// of an agent that is not running. Corrupt files give an error wrapping
// ErrCorrupt.
func ReadFile(path string) ([]Entry, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	raw, err := decodeFile(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return rawEntries(raw), nil
}

func rawEntries(raw map[rawKey]rawValue) []Entry {
	out := make([]Entry, 0, len(raw))
	for k, v := range raw {
		// decodeFile validated every key.
		e, _ := decodeEntry(&k, &v)
		out = append(out, e)
	}
	return out
}
