package api

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/tier"
)

// llama-server's slot actions as a compatible convenience (issue 25): POST
// /slots/{id}?action=save|restore|erase with {"filename": NAME}, NAME a plain file name
// under --slot-save-path. A slot is a session sequence (0..--parallel-1). Files are
// written atomically and carry the model key and a checksum (package tier's format), so
// a restore of a torn, corrupt or foreign file is refused with 400, never loaded.

type slotRequest struct {
	Filename string `json:"filename"`
}

func (s *Server) handleSlotAction(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.Atoi(r.PathValue("id"))
	if err != nil || id < 0 || id >= s.info.Parallel {
		writeAPIError(w, badRequest("slot id %q: want 0..%d", r.PathValue("id"), s.info.Parallel-1))
		return
	}
	action := r.URL.Query().Get("action")
	if action == "erase" {
		res, err := s.eng.Send(r.Context(), engine.EraseSlot{Seq: id})
		if err == nil {
			err = res.Err
		}
		if err != nil {
			writeAPIError(w, errorFor(err))
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"id_slot": id, "n_erased": res.Erased})
		return
	}
	if action != "save" && action != "restore" {
		writeAPIError(w, badRequest("action must be save, restore or erase, got %q", action))
		return
	}
	if s.info.SlotSavePath == "" || s.info.ModelKey == "" {
		writeError(w, http.StatusNotImplemented, "not_supported_error", "slot save and restore are off: start the server with --slot-save-path DIR")
		return
	}
	var b slotRequest
	if e := s.decodeBody(w, r, &b); e != nil {
		writeAPIError(w, e)
		return
	}
	name := b.Filename
	if name == "" || name != filepath.Base(name) || strings.ContainsAny(name, `/\`) || name == "." || name == ".." || strings.HasPrefix(name, ".tmp-") {
		writeAPIError(w, badRequest("filename must be a plain file name under --slot-save-path, got %q", name))
		return
	}
	start := time.Now()
	if action == "save" {
		res, err := s.eng.Send(r.Context(), engine.SaveSlot{Seq: id})
		if err == nil {
			err = res.Err
		}
		if err != nil {
			writeAPIError(w, errorFor(err))
			return
		}
		file := tier.EncodeFile(s.info.ModelKey, tier.Meta{Tokens: res.Tokens}, res.Data)
		if err := tier.WriteFileAtomic(s.info.SlotSavePath, name, file); err != nil {
			writeError(w, http.StatusInternalServerError, "server_error", fmt.Sprintf("saving slot %d: %v", id, err))
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"id_slot": id, "filename": name, "n_saved": len(res.Tokens),
			"n_written": len(file), "timings": map[string]any{"save_ms": float64(time.Since(start).Microseconds()) / 1000}})
		return
	}
	raw, err := os.ReadFile(filepath.Join(s.info.SlotSavePath, name))
	if err != nil {
		writeAPIError(w, badRequest("reading %q: %v", name, err))
		return
	}
	meta, payload, err := tier.DecodeFile(raw, s.info.ModelKey)
	if err == nil && meta.D != 0 {
		err = fmt.Errorf("the file holds a pool's own cells (branch position %d), not a slot", meta.D)
	}
	if err != nil {
		writeAPIError(w, badRequest("%q cannot be restored here: %v", name, err))
		return
	}
	res, err := s.eng.Send(r.Context(), engine.LoadSlot{Seq: id, Tokens: meta.Tokens, Data: payload})
	if err == nil {
		err = res.Err
	}
	if err != nil {
		writeAPIError(w, errorFor(err))
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"id_slot": id, "filename": name, "n_restored": len(meta.Tokens),
		"n_read": len(raw), "timings": map[string]any{"restore_ms": float64(time.Since(start).Microseconds()) / 1000}})
}
