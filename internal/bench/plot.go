package bench

import (
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"os"
	"strings"
)

// A small line-plot writer for the episode timeline: two stacked panels sharing the
// time axis, lines and step lines, horizontal reference lines, and labels in a built-in
// 5×7 bitmap font. Go's image/png is all it needs; a plotting module (gonum/plot) would
// bring fonts, vector back ends and a dozen dependencies for two panels of lines.

type point struct{ x, y float64 }

// plotSeries is one line; NaN y values leave gaps.
type plotSeries struct {
	name string
	pts  []point
	col  color.RGBA
	step bool // a step line (the value holds until the next point)
}

// hline is a horizontal reference line of the top panel.
type hline struct {
	y    float64
	name string
	col  color.RGBA
}

// plot is the whole figure: a title, the top panel (its y range from the data and the
// reference lines) and the bottom panel (0..bottomMax).
type plot struct {
	title       string
	xMax        float64
	top         []plotSeries
	topLines    []hline
	topLabel    string
	bottom      []plotSeries
	bottomLabel string
	bottomMax   float64
}

var (
	colBlack  = color.RGBA{0x20, 0x20, 0x20, 0xff}
	colGrey   = color.RGBA{0x99, 0x99, 0x99, 0xff}
	colLight  = color.RGBA{0xe4, 0xe4, 0xe4, 0xff}
	colBlue   = color.RGBA{0x1f, 0x5f, 0xbf, 0xff}
	colOrange = color.RGBA{0xe0, 0x80, 0x10, 0xff}
	colRed    = color.RGBA{0xd0, 0x20, 0x20, 0xff}
	colPink   = color.RGBA{0xf0, 0x90, 0x90, 0xff}
	colGreen  = color.RGBA{0x20, 0x90, 0x40, 0xff}
	colWhite  = color.RGBA{0xff, 0xff, 0xff, 0xff}
)

const (
	plotW, plotH        = 1200, 640
	plotL, plotR        = 80, 1170
	topY0, topY1        = 50, 400 // top panel, pixel rows (top, bottom)
	bottomY0, bottomY1  = 440, 590
	glyphScale, glyphPx = 2, 5 * 2
)

type canvas struct{ img *image.RGBA }

func (c canvas) set(x, y int, col color.RGBA) {
	if x >= 0 && y >= 0 && x < plotW && y < plotH {
		c.img.SetRGBA(x, y, col)
	}
}

// line draws a segment two pixels thick (Bresenham).
func (c canvas) line(x0, y0, x1, y1 int, col color.RGBA, thick bool) {
	dx, dy := abs(x1-x0), -abs(y1-y0)
	sx, sy := sign(x1-x0), sign(y1-y0)
	err := dx + dy
	for {
		c.set(x0, y0, col)
		if thick {
			c.set(x0+1, y0, col)
			c.set(x0, y0+1, col)
		}
		if x0 == x1 && y0 == y1 {
			return
		}
		e2 := 2 * err
		if e2 >= dy {
			err += dy
			x0 += sx
		}
		if e2 <= dx {
			err += dx
			y0 += sy
		}
	}
}

// dashed draws a horizontal dashed line.
func (c canvas) dashed(x0, x1, y int, col color.RGBA) {
	for x := x0; x <= x1; x++ {
		if (x/6)%2 == 0 {
			c.set(x, y, col)
			c.set(x, y+1, col)
		}
	}
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

func sign(v int) int {
	switch {
	case v < 0:
		return -1
	case v > 0:
		return 1
	}
	return 0
}

// text draws s (upper-cased) with its top-left corner at x, y; it returns the width.
func (c canvas) text(x, y int, s string, col color.RGBA) int {
	x0 := x
	for _, r := range strings.ToUpper(s) {
		g, ok := glyphs[r]
		if !ok {
			g = glyphs['?']
		}
		for row, bits := range g {
			for colx, b := range bits {
				if b != '#' {
					continue
				}
				for dy := range glyphScale {
					for dx := range glyphScale {
						c.set(x+colx*glyphScale+dx, y+row*glyphScale+dy, col)
					}
				}
			}
		}
		x += glyphPx + glyphScale
	}
	return x - x0
}

func textWidth(s string) int { return len([]rune(s)) * (glyphPx + glyphScale) }

// niceStep is a 1-2-5 step that divides span into at most n intervals.
func niceStep(span float64, n int) float64 {
	if span <= 0 {
		return 1
	}
	raw := span / float64(n)
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*mag >= raw {
			return m * mag
		}
	}
	return 10 * mag
}

func fmtTick(v float64) string {
	if v == math.Trunc(v) {
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%g", v)
}

// panel draws one panel's frame, grid, y ticks, series and legend.
func (c canvas) panel(y0, y1 int, yMax, xMax float64, series []plotSeries, lines []hline, label string, xLabels bool) {
	px := func(x float64) int { return plotL + int(math.Round(x/xMax*float64(plotR-plotL))) }
	py := func(y float64) int { return y1 - int(math.Round(y/yMax*float64(y1-y0))) }
	ys := niceStep(yMax, 5)
	for v := 0.0; v <= yMax+1e-9; v += ys {
		y := py(v)
		for x := plotL; x <= plotR; x++ {
			c.set(x, y, colLight)
		}
		l := fmtTick(v)
		c.text(plotL-8-textWidth(l), y-7, l, colBlack)
	}
	xs := niceStep(xMax, 12)
	for v := 0.0; v <= xMax+1e-9; v += xs {
		x := px(v)
		for y := y0; y <= y1; y++ {
			if y%4 == 0 {
				c.set(x, y, colLight)
			}
		}
		if xLabels {
			l := fmtTick(v)
			c.text(x-textWidth(l)/2, y1+8, l, colBlack)
		}
	}
	for x := plotL; x <= plotR; x++ {
		c.set(x, y1, colBlack)
		c.set(x, y0, colBlack)
	}
	for y := y0; y <= y1; y++ {
		c.set(plotL, y, colBlack)
		c.set(plotR, y, colBlack)
	}
	c.text(plotL-8-textWidth(label), y0-20, label, colBlack)
	for _, h := range lines {
		if h.y <= yMax {
			c.dashed(plotL, plotR, py(h.y), h.col)
		}
	}
	for _, s := range series {
		var prev *point
		for i := range s.pts {
			p := s.pts[i]
			if math.IsNaN(p.y) {
				prev = nil
				continue
			}
			if prev != nil {
				if s.step {
					c.line(px(prev.x), py(prev.y), px(p.x), py(prev.y), s.col, true)
					c.line(px(p.x), py(prev.y), px(p.x), py(p.y), s.col, true)
				} else {
					c.line(px(prev.x), py(prev.y), px(p.x), py(p.y), s.col, true)
				}
			}
			prev = &s.pts[i]
		}
	}
	// Legend, right-aligned inside the panel's top edge.
	x := plotR - 8
	items := []struct {
		name string
		col  color.RGBA
	}{}
	for _, s := range series {
		items = append(items, struct {
			name string
			col  color.RGBA
		}{s.name, s.col})
	}
	for _, h := range lines {
		items = append(items, struct {
			name string
			col  color.RGBA
		}{h.name, h.col})
	}
	for i := len(items) - 1; i >= 0; i-- {
		x -= textWidth(items[i].name)
		c.text(x, y0+6, items[i].name, items[i].col)
		x -= 24
	}
}

// writePlot renders p to a PNG file.
func writePlot(path string, p plot) error {
	c := canvas{img: image.NewRGBA(image.Rect(0, 0, plotW, plotH))}
	for y := range plotH {
		for x := range plotW {
			c.img.SetRGBA(x, y, colWhite)
		}
	}
	c.text(plotL, 14, p.title, colBlack)
	yMax := 1.0
	for _, s := range p.top {
		for _, pt := range s.pts {
			if !math.IsNaN(pt.y) {
				yMax = max(yMax, pt.y)
			}
		}
	}
	for _, h := range p.topLines {
		yMax = max(yMax, h.y)
	}
	yMax = math.Ceil(yMax*1.1/niceStep(yMax*1.1, 5)) * niceStep(yMax*1.1, 5)
	xMax := max(p.xMax, 1)
	c.panel(topY0, topY1, yMax, xMax, p.top, p.topLines, p.topLabel, false)
	c.panel(bottomY0, bottomY1, max(p.bottomMax, 1), xMax, p.bottom, nil, p.bottomLabel, true)
	c.text((plotL+plotR)/2-textWidth("time s")/2, bottomY1+30, "time s", colBlack)
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := png.Encode(f, c.img); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// glyphs is a 5×7 bitmap font: upper-case letters, digits and a little punctuation.
var glyphs = map[rune][7]string{
	'A':  {".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"},
	'B':  {"####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."},
	'C':  {".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."},
	'D':  {"####.", "#...#", "#...#", "#...#", "#...#", "#...#", "####."},
	'E':  {"#####", "#....", "#....", "####.", "#....", "#....", "#####"},
	'F':  {"#####", "#....", "#....", "####.", "#....", "#....", "#...."},
	'G':  {".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".###."},
	'H':  {"#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"},
	'I':  {".###.", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."},
	'J':  {"..###", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."},
	'K':  {"#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"},
	'L':  {"#....", "#....", "#....", "#....", "#....", "#....", "#####"},
	'M':  {"#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"},
	'N':  {"#...#", "#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#"},
	'O':  {".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."},
	'P':  {"####.", "#...#", "#...#", "####.", "#....", "#....", "#...."},
	'Q':  {".###.", "#...#", "#...#", "#...#", "#.#.#", "#..#.", ".##.#"},
	'R':  {"####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"},
	'S':  {".####", "#....", "#....", ".###.", "....#", "....#", "####."},
	'T':  {"#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."},
	'U':  {"#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."},
	'V':  {"#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."},
	'W':  {"#...#", "#...#", "#...#", "#.#.#", "#.#.#", "#.#.#", ".#.#."},
	'X':  {"#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"},
	'Y':  {"#...#", "#...#", ".#.#.", "..#..", "..#..", "..#..", "..#.."},
	'Z':  {"#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"},
	'0':  {".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."},
	'1':  {"..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."},
	'2':  {".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"},
	'3':  {"#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."},
	'4':  {"...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."},
	'5':  {"#####", "#....", "####.", "....#", "....#", "#...#", ".###."},
	'6':  {"..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."},
	'7':  {"#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."},
	'8':  {".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."},
	'9':  {".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."},
	' ':  {".....", ".....", ".....", ".....", ".....", ".....", "....."},
	'.':  {".....", ".....", ".....", ".....", ".....", ".##..", ".##.."},
	',':  {".....", ".....", ".....", ".....", ".##..", "..#..", ".#..."},
	':':  {".....", ".##..", ".##..", ".....", ".##..", ".##..", "....."},
	'/':  {".....", "....#", "...#.", "..#..", ".#...", "#....", "....."},
	'-':  {".....", ".....", ".....", "#####", ".....", ".....", "....."},
	'+':  {".....", "..#..", "..#..", "#####", "..#..", "..#..", "....."},
	'=':  {".....", ".....", "#####", ".....", "#####", ".....", "....."},
	'(':  {"...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#."},
	')':  {".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#..."},
	'%':  {"##...", "##..#", "...#.", "..#..", ".#...", "#..##", "...##"},
	'<':  {"...#.", "..#..", ".#...", "#....", ".#...", "..#..", "...#."},
	'\'': {"..#..", "..#..", ".#...", ".....", ".....", ".....", "....."},
	'>':  {".#...", "..#..", "...#.", "....#", "...#.", "..#..", ".#..."},
	'?':  {".###.", "#...#", "....#", "...#.", "..#..", ".....", "..#.."},
	'×':  {".....", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "....."},
}
